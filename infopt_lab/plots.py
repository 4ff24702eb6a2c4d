"""Matplotlib figures the notebooks share: one small function per kind of figure.

Each function draws on an Axes (a new one when `ax` is None) and returns it;
the notebook cell adds its own touches and ends with `plt.show()`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    """The given Axes, or a fresh figure's."""
    return ax if ax is not None else plt.subplots(figsize=figsize)[1]


def top_tokens_bar(labels: Sequence[str], probs: Sequence[float], ax: Axes | None = None,
                   title: str = "") -> Axes:
    """Horizontal bars of next-token probabilities, the most likely on top."""
    ax = _axes(ax, (6, 0.45 * len(labels) + 1.2))
    y = np.arange(len(labels))
    ax.barh(y, probs, color="tab:blue")
    ax.set_yticks(y, labels, family="monospace")
    ax.invert_yaxis()
    for i, p in enumerate(probs):
        ax.text(p, i, f" {p:.3f}", va="center")
    ax.set_xlim(0, max(max(probs) * 1.25, 0.05))
    ax.set_xlabel("probability")
    ax.set_title(title)
    return ax


def ranked_probs(curves: Mapping[str, Sequence[float]], ax: Axes | None = None,
                 title: str = "") -> Axes:
    """One line per setting: probabilities of the most likely tokens, in rank order."""
    ax = _axes(ax, (6, 3.2))
    for label, probs in curves.items():
        ax.plot(np.arange(1, len(probs) + 1), probs, marker="o", ms=3, label=label)
    ax.set_xlabel("rank of the token")
    ax.set_ylabel("probability")
    ax.set_title(title)
    ax.legend()
    return ax


def token_timeline(token_times_s: Sequence[float], ax: Axes | None = None, title: str = "") -> Axes:
    """When each new token arrived (ms after the request): the TTFT gap, then steady decode."""
    ax = _axes(ax, (6, 3.2))
    t_ms = np.asarray(token_times_s) * 1e3
    n = np.arange(1, len(t_ms) + 1)
    ax.plot(n, t_ms, marker="o", ms=3, color="tab:blue", label="token arrival")
    ax.plot([0, 1], [0, t_ms[0]], color="tab:red", lw=3, label=f"TTFT = {t_ms[0]:.1f} ms")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("ms since the request started")
    ax.set_title(title)
    ax.legend()
    return ax


def gaps_bar(token_times_s: Sequence[float], ax: Axes | None = None, title: str = "") -> Axes:
    """The wait before each token: TTFT for the first (red), inter-token latency after it."""
    ax = _axes(ax, (6, 3.2))
    gaps_ms = np.diff(np.concatenate([[0.0], token_times_s])) * 1e3
    colors = ["tab:red"] + ["tab:blue"] * (len(gaps_ms) - 1)
    ax.bar(np.arange(1, len(gaps_ms) + 1), gaps_ms, color=colors)
    ax.set_xlabel("token")
    ax.set_ylabel("wait before it (ms)")
    ax.set_title(title)
    return ax


def runs_with_percentiles(values: Sequence[float], pcts: Mapping[str, float],
                          ax: Axes | None = None, ylabel: str = "", title: str = "") -> Axes:
    """One dot per run, with a dashed line at each percentile."""
    ax = _axes(ax, (4, 3))
    ax.plot(np.arange(1, len(values) + 1), values, "o", color="tab:blue")
    for (name, v), style in zip(pcts.items(), ("--", ":", "-.")):
        ax.axhline(v, color="gray", ls=style, label=f"{name} = {v:.2f}")
    ax.set_xlabel("run")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return ax


def memory_bars(values: Mapping[str, float], unit: str = "GB", ax: Axes | None = None,
                highlight: str | None = None, title: str = "") -> Axes:
    """Memory per precision as labelled bars; `highlight` colours one of them."""
    ax = _axes(ax, (6, 3))
    names = list(values)
    colors = ["tab:orange" if n == highlight else "tab:blue" for n in names]
    bars = ax.bar(range(len(names)), list(values.values()), color=colors)
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in values.values()], padding=2)
    ax.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names])
    ax.set_ylabel(unit)
    ax.set_ylim(0, max(values.values()) * 1.18)
    ax.set_title(title)
    return ax


def roofline(peak_flops: float, bandwidth: float, measured: Mapping[str, tuple[Sequence[float], Sequence[float]]],
             predicted: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
             ax: Axes | None = None, title: str = "") -> Axes:
    """Log-log roofline: the bound min(peak, bandwidth x intensity), measured points, predicted points.

    `measured` and `predicted` map a label to (intensities in FLOP/byte, FLOP/s); a predicted
    series is drawn hollow in the colour of the measured series with the same label.
    """
    ax = _axes(ax, (7, 4.2))
    xs = [x for series in list(measured.values()) + list((predicted or {}).values()) for x in series[0]]
    ridge = peak_flops / bandwidth
    lo, hi = min(xs + [ridge]) / 4, max(xs + [ridge]) * 4
    grid = np.geomspace(lo, hi, 200)
    ax.loglog(grid, np.minimum(peak_flops, bandwidth * grid) / 1e9, color="black", lw=2, label="roofline (bound)")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.text(ridge, peak_flops / 1e9 / 1.15, f" ridge {ridge:.1f} FLOP/B", va="top", color="gray")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (label, (x, y)), color in zip(measured.items(), colors):
        ax.loglog(x, np.asarray(y) / 1e9, "o", color=color, label=f"{label}, measured")
        if predicted and label in predicted:
            px, py = predicted[label]
            ax.loglog(px, np.asarray(py) / 1e9, "o", mfc="none", color=color, label=f"{label}, predicted")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    return ax


def lines(x: Sequence[float], curves: Mapping[str, Sequence[float]], ax: Axes | None = None,
          xlabel: str = "", ylabel: str = "", title: str = "", logx: bool = False,
          marker: str | None = "o") -> Axes:
    """One line per label against a shared x axis (prefill time vs length, time per step vs position)."""
    ax = _axes(ax, (6, 3.4))
    for label, y in curves.items():
        ax.plot(x, y, marker=marker, ms=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(x), [str(v) for v in x])
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return ax


def batch_scaling(batch_sizes: Sequence[int], step_s: Sequence[float], ax: Axes | None = None,
                  title: str = "") -> Axes:
    """Decode throughput (all requests) and per-request speed against batch size, from step times."""
    ax = _axes(ax, (6, 3.6))
    b, t = np.asarray(batch_sizes, dtype=float), np.asarray(step_s, dtype=float)
    ax.plot(b, b / t, "o-", color="tab:blue", label="total tokens/s (throughput)")
    ax.plot(b, b / t[0], ":", color="tab:blue", alpha=0.6, label="perfect scaling from batch 1")
    ax.plot(b, 1 / t, "s-", color="tab:orange", label="tokens/s of each request")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(batch_sizes), [str(v) for v in batch_sizes])
    ax.set_xlabel("batch size (requests decoded together)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax


def gantt(timeline: Sequence[Sequence[tuple[int, int, str]]], n_slots: int, ax: Axes | None = None,
          title: str = "", times: Sequence[float] | None = None) -> Axes:
    """Batch slots over steps: a colour per request, hatched grey where a finished request pads its row.

    `timeline` holds, per step, (slot, request id, "prefill" | "decode" | "padding") rows: a
    simulator's `timeline` or `[r.rows for r in outs.stats.timeline]`. With `times` (one start
    per step, plus the end) the x axis is seconds instead of steps.
    """
    ax = _axes(ax, (9, 0.35 * n_slots + 1.3))
    edges = list(times) if times is not None else list(range(len(timeline) + 1))
    colours = plt.get_cmap("tab20").colors
    runs: dict[tuple[int, int, str], list[list[float]]] = {}
    for step, rows in enumerate(timeline):
        for slot, rid, kind in rows:
            kind = "padding" if kind == "padding" else "work"
            spans = runs.setdefault((slot, rid, kind), [])
            if spans and spans[-1][1] == edges[step]:
                spans[-1][1] = edges[step + 1]
            else:
                spans.append([edges[step], edges[step + 1]])
    for (slot, rid, kind), spans in runs.items():
        bars = [(a, b - a) for a, b in spans]
        if kind == "padding":
            ax.broken_barh(bars, (slot - 0.4, 0.8), facecolor="0.85", hatch="///", edgecolor="0.6", lw=0)
        else:
            ax.broken_barh(bars, (slot - 0.4, 0.8), facecolor=colours[rid % len(colours)], edgecolor="white", lw=0.5)
            for a, w in bars:
                if w > 0.04 * (edges[-1] - edges[0]):
                    ax.text(a + w / 2, slot, str(rid), ha="center", va="center", fontsize=7)
    ax.set_ylim(n_slots - 0.5, -0.5)
    ax.set_yticks(range(n_slots), [f"slot {i}" for i in range(n_slots)])
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel("seconds" if times is not None else "step")
    ax.set_title(title)
    return ax


def block_table(tables: Mapping[str, Sequence[int]], seq_lens: Mapping[str, int], num_blocks: int,
                block_size: int, ax: Axes | None = None, title: str = "") -> Axes:
    """The paged KV pool as a row of physical blocks, coloured by the sequence owning each, filled to its tokens.

    Each sequence's block table is written beside its name: logical block i -> physical block id.
    """
    ax = _axes(ax, (10, 0.5 * len(tables) + 2.2))
    colours = plt.get_cmap("tab10").colors
    for b in range(num_blocks):
        ax.add_patch(plt.Rectangle((b, 0), 0.92, 1, facecolor="white", edgecolor="0.6"))
        ax.text(b + 0.46, -0.25, str(b), ha="center", va="center", fontsize=7, color="0.4")
    for row, (name, table) in enumerate(tables.items()):
        colour = colours[row % len(colours)]
        for i, block in enumerate(table):
            used = min(block_size, seq_lens[name] - i * block_size) / block_size
            ax.add_patch(plt.Rectangle((block, 0), 0.92 * used, 1, facecolor=colour, alpha=0.85))
            ax.text(block + 0.46, 0.5, f"{name}\n#{i}", ha="center", va="center", fontsize=7)
        ax.text(0, -0.75 - 0.45 * row, f"{name} ({seq_lens[name]} tokens): table {list(table)}",
                color=colour, fontsize=9, family="monospace", va="center")
    ax.set_xlim(-0.2, num_blocks + 0.2)
    ax.set_ylim(-0.95 - 0.45 * len(tables), 1.2)
    ax.axis("off")
    ax.set_title(title)
    return ax
