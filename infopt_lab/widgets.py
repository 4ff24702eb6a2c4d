"""ipywidgets controls the notebooks share.

Each builder draws its first state at once and returns the widget; it never
waits for input, so a notebook runs the same headless (nbval, nbclient).
"""
from __future__ import annotations

from collections.abc import Mapping

import ipywidgets as W
import matplotlib.pyplot as plt

from .metrics import weight_memory_gb
from .plots import memory_bars


def memory_line(num_params: float, precision: str, bytes_per_param: float) -> str:
    """'precision: N parameters x b bytes = M GB' for one model size (GB = 1024**3 bytes)."""
    gb = weight_memory_gb(num_params, bytes_per_param)
    return (f"{precision}: {num_params:,.0f} parameters x {bytes_per_param:g} bytes "
            f"= {gb:,.2f} GB ({gb * 1024:,.1f} MB)")


def memory_calculator(precisions: Mapping[str, float], num_params: float = 7e9,
                      precision: str | None = None) -> W.VBox:
    """Parameters (log slider) x precision (dropdown) -> weight memory, printed and plotted."""
    slider = W.FloatLogSlider(value=num_params, base=10, min=6, max=12, step=0.01,
                              description="parameters", readout_format=".3s",
                              continuous_update=False, layout=W.Layout(width="420px"))
    dropdown = W.Dropdown(options=list(precisions), value=precision or list(precisions)[1],
                          description="precision")
    out = W.Output()

    def redraw(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            n, name = slider.value, dropdown.value
            print(memory_line(n, name, precisions[name]))
            gb = {p: weight_memory_gb(n, b) for p, b in precisions.items()}
            memory_bars(gb, "GB", ax=plt.subplots(figsize=(6, 2.6))[1], highlight=name,
                        title=f"weights of a {n / 1e9:.3g}B-parameter model")
            plt.show()

    slider.observe(redraw, "value")
    dropdown.observe(redraw, "value")
    redraw()
    return W.VBox([W.HBox([slider, dropdown]), out])
