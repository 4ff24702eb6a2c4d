"""The optimization ladder behind `infopt-lab bench`: each rung measured side by side.

Every rung runs its contenders in one process on the same weights, prompt and
length, and reports ratios, so the figures mean the same on any machine.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .device import get_device, synchronize
from .loading import load_model, resolve_model_dir
from .metrics import measure_bandwidth_gbs, model_weight_bytes

DEFAULT_PROMPT = "import os\n\n\ndef walk_files(root):\n    "


@dataclass
class Result:
    name: str
    rows: list[tuple[str, str]] = field(default_factory=list)   # (label, formatted value)
    values: dict[str, float | bool] = field(default_factory=dict)  # raw figures, for tests and notebooks

    def add(self, label: str, value: str) -> None:
        self.rows.append((label, value))

    def render(self) -> str:
        width = max((len(label) for label, _ in self.rows), default=0)
        lines = [f"== {self.name} =="] + [f"  {label:<{width}} : {value}" for label, value in self.rows]
        return "\n".join(lines)


def _median_time(fn: Callable[[], object], repeats: int, device) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench_decode(model_name: str = "target", new_tokens: int = 128, repeats: int = 3,
                 prompt: str = DEFAULT_PROMPT) -> Result:
    """Batch-1 greedy decode with our KV cache vs transformers' generate on the same weights."""
    from transformers import AutoModelForCausalLM
    from .generate import generate
    device = get_device()
    model, tok = load_model(model_name, device=device)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name),
                                              dtype=next(model.parameters()).dtype).to(device).eval()
    ids = torch.tensor([tok.encode(prompt)], device=device)
    n_prompt = ids.shape[1]

    def ours():
        return generate(model, tok, prompt, max_new_tokens=new_tokens, stop_at_eos=False)

    def theirs():
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)

    ours(), theirs()                                           # warm-up: allocator, kernels, caches
    t_ours = _median_time(ours, repeats, device)
    t_hf = _median_time(theirs, repeats, device)
    same = ours().token_ids == theirs()[0, n_prompt:].tolist()
    out = ours()                                               # for TTFT and TPOT

    weight_bytes = model_weight_bytes(model)
    bandwidth = measure_bandwidth_gbs(device=device)
    bound = bandwidth * 1e9 / weight_bytes                     # tokens/s if each step streamed the weights once
    r = Result("decode: batch 1, greedy, KV cache")
    r.add("model", f"{model_name} ({model.num_parameters() / 1e6:.2f}M params, "
                   f"{next(model.parameters()).dtype}, {device})")
    r.add("prompt / new tokens", f"{n_prompt} / {new_tokens}")
    r.add("infopt_lab tokens/s", f"{new_tokens / t_ours:.1f}  (TTFT {out.ttft_s * 1e3:.1f} ms, "
                                 f"TPOT {out.tpot_s * 1e3:.2f} ms)")
    r.add("transformers tokens/s", f"{new_tokens / t_hf:.1f}")
    r.add("speedup vs transformers", f"{t_hf / t_ours:.2f}x")
    r.add("same greedy tokens", str(same))
    r.add("weight bytes", f"{weight_bytes / 2**20:.1f} MiB")
    r.add("measured bandwidth", f"{bandwidth:.1f} GB/s")
    r.add("weight-streaming bound", f"{bound:.0f} tokens/s")
    r.add("fraction of bound reached", f"{new_tokens / t_ours / bound:.1%}")
    r.values = {"same_tokens": same, "speedup": t_hf / t_ours, "fraction_of_bound": new_tokens / t_ours / bound}
    return r


LADDER: dict[str, Callable[..., Result]] = {
    "decode": bench_decode,
}


def run(only: list[str] | None = None, **kwargs) -> list[Result]:
    """Run the named rungs (all by default) and print each as it finishes."""
    names = only or list(LADDER)
    unknown = [n for n in names if n not in LADDER]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown}; choose from {list(LADDER)}")
    results = []
    for name in names:
        result = LADDER[name](**kwargs)
        print(result.render(), flush=True)
        results.append(result)
    return results
