"""The overhead rung: eager against compiled decoding at each precision, against the memory wall, and llama.cpp
on the very GGUF file the real model came from when llama-cpp-python is installed (`--against llama.cpp`).

Every contender decodes the same prompt greedily for the same number of new tokens, in turn, round after
round (`timing.interleaved_runs`), and keeps its fastest round: a neighbour only ever slows a run down.
For each: tokens/s end to end (prefill included, as `decode_tokens_per_s`), the time per output token, the
weight bytes one step streams, and the GB/s that makes, against the copy probe's bound and the fastest
one-row matrix product this machine runs (its matvec ceiling).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device import cpu_flags, get_device
from ..generate import generate
from ..loading import load_model
from ..quantize import quantize_model, use_q8_kernel, weight_bytes
from ..timing import interleaved_runs, matvec_bandwidth_gbs, measure_bandwidth_gbs
from .decode import DEFAULT_PROMPT, decode_throughput
from .result import Result

LLAMA_CPP = "llama.cpp"
AGAINST = (LLAMA_CPP,)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"   # a native x86 build without ggml's AMX path


def llama_cmake_args(amx: bool | None = None) -> str:
    """The CMAKE_ARGS that build llama.cpp for this CPU: native, and on a CPU that reports AMX, without ggml's AMX
    path (its tile instructions fault in some virtual machines: a 2-core Intel Xeon with AMX measured here died
    with SIGSEGV in ggml_backend_amx_mul_mat on its first token)."""
    args = "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"
    if amx is None:
        amx = "amx_tile" in cpu_flags()
    return f"{args} -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'" if amx else args


def llama_install() -> str:
    """How to install llama-cpp-python for this CPU, in one line."""
    return (f'from the course folder, CMAKE_ARGS="{llama_cmake_args()}" pip install -e ".[llama]" builds llama.cpp '
            "for this CPU (several minutes; see the README)")


# -- llama.cpp through llama-cpp-python ----------------------------------------------------------------
def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot run here (a line that says how to install it); None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed: {llama_install()}"
    return None


def child_failure(argv: list[str], timeout_s: float = 300) -> str | None:
    """None when the command exits with status 0; else how it ended, in words (the signal that killed it, its
    status and the last line it wrote to stderr, or that it was stopped after `timeout_s`)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"stopped after {timeout_s:g} s without finishing"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name}"
    last = (done.stderr.strip().splitlines() or [""])[-1][:200]
    return f"exit status {done.returncode}: {last}" if last else f"exit status {done.returncode}"


_LLAMA_PROBE = ("import sys; from llama_cpp import Llama; "
                "m = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), verbose=False); "
                "m('def', max_tokens=4, temperature=0.0)")


def llama_cpp_crash(gguf: str | Path, threads: int) -> str | None:
    """Why this build of llama.cpp cannot decode the file here, or None: four greedy tokens run in a child process
    first, since a build whose instructions the machine refuses kills the process it runs in, and with it every
    measurement of the rung."""
    how = child_failure([sys.executable, "-c", _LLAMA_PROBE, str(gguf), str(threads)])
    if how is None:
        return None
    hint = (" This CPU reports AMX, which a native build of ggml uses and some virtual machines refuse; rebuild "
            f'without it: CMAKE_ARGS="{llama_cmake_args(amx=True)}" pip install --force-reinstall --no-cache-dir '
            "llama-cpp-python") if "amx_tile" in cpu_flags() else ""
    return f"llama.cpp failed to decode 4 tokens of {Path(gguf).name} in a child process ({how}); left out.{hint}"


@dataclass
class LlamaRun:
    """One greedy run of llama.cpp: its tokens, and when the first and the last were ready."""
    token_ids: list[int]
    ttft_s: float
    e2e_s: float

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(1, len(self.token_ids) - 1)


class LlamaCpp:
    """llama.cpp on one GGUF file, greedy, with this process's thread count; each run prefills from scratch."""

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int = 512):
        from llama_cpp import Llama
        self.path = Path(gguf)
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False)

    def greedy(self, prompt: str, new_tokens: int) -> LlamaRun:
        ids = self.llm.tokenize(prompt.encode(), add_bos=True, special=False)
        self.llm.reset()                                 # no prefix reuse: the prompt is prefilled every run
        out, first = [], None
        start = time.perf_counter()
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            first = time.perf_counter() - start if first is None else first
            out.append(token)
            if len(out) == new_tokens:                   # on past end-of-sequence, as stop_at_eos=False does
                break
        return LlamaRun(out, first, time.perf_counter() - start)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the file's tensors (the file less its metadata): what one step streams."""
        from gguf import GGUFReader
        return sum(int(t.n_bytes) for t in GGUFReader(str(self.path)).tensors)


def rows_cost(layer, rows: tuple[int, ...], repeats: int = 20) -> dict[int, float]:
    """Fastest seconds of one call of `layer` on each number of rows, the row counts timed in turn."""
    g = torch.Generator().manual_seed(0)
    device = next(iter(layer.buffers())).device
    inputs = {n: torch.randn(n, layer.in_features, generator=g).to(device) for n in rows}
    with torch.inference_mode():
        runs = interleaved_runs({n: (lambda x=x: layer(x)) for n, x in inputs.items()}, repeats=repeats, warmup=2,
                                device=device)
    return {n: min(t) for n, t in runs.items()}


# -- the rung --------------------------------------------------------------------------------------------
Q8 = " (q8 kernel)"             # the same integers through the hand-written int8-activation kernel (cpu_q8.py)
PRECISIONS = ("fp32", "bf16", "int8", "int4 g64", "int8" + Q8, "int4 g64" + Q8)


def default_precisions() -> tuple[str, ...]:
    """Every precision, the hand-written kernel's where it runs here."""
    from ..cpu_q8 import available
    return PRECISIONS if available() else tuple(p for p in PRECISIONS if not p.endswith(Q8))


def contenders(model_name: str, device, precisions: tuple[str, ...] = PRECISIONS) -> dict[str, torch.nn.Module]:
    """fp32 (always: the baseline), bf16, int8 and int4 g64 models, and the quantized ones again on the hand-written
    kernel; fp32 loaded twice (compiling re-lays its weights for the lowering it takes, and the eager baseline
    keeps the layout it loads with)."""
    fp32, _ = load_model(model_name, dtype=torch.float32, device=device)
    models = {"fp32": fp32, "fp32 compiled": load_model(model_name, dtype=torch.float32, device=device)[0]}
    if "bf16" in precisions:
        models["bf16"] = load_model(model_name, dtype=torch.bfloat16, device=device)[0]
    if "int8" in precisions:
        models["int8"] = quantize_model(fp32, "int8")
    if "int4 g64" in precisions:
        models["int4 g64"] = quantize_model(fp32, "int4", group_size=64)
    for name, scheme, group in (("int8" + Q8, "int8", None), ("int4 g64" + Q8, "int4", 64)):
        if name in precisions:
            models[name] = quantize_model(fp32, scheme, group_size=group)
            use_q8_kernel(models[name])                   # ValueError, saying why, where it cannot run
    return models


@dataclass
class Timed:
    """Each contender's fastest of the interleaved rounds: tokens/s end to end, TPOT, and that run's output; and
    every round's tokens/s (`rounds[name][i]`: round i, in which every contender ran once, one after another)."""
    rate: dict[str, float]
    tpot: dict[str, float]
    best: dict[str, object]
    rounds: dict[str, list[float]]

    def ratios(self, name: str, baseline: str) -> list[float]:
        """`name`'s tokens/s over `baseline`'s, round by round: how far one run's ratio can move."""
        return [a / b for a, b in zip(self.rounds[name], self.rounds[baseline])]


def time_contenders(models: dict, tok, prompt: str, new_tokens: int, repeats: int, device,
                    llama: LlamaCpp | None = None) -> Timed:
    """Every model eager and compiled (fp32's own copy compiled), and llama.cpp, timed in turn round after round."""
    kw = dict(max_new_tokens=new_tokens, stop_at_eos=False)
    outputs: dict[str, list] = {}                                  # every run's output, in order

    def ours(name: str, model, compile: bool):
        return lambda: outputs.setdefault(name, []).append(generate(model, tok, prompt, compile=compile, **kw))

    fns = {}
    for name, m in models.items():
        fns[name] = ours(name, m, name == "fp32 compiled")
        if name not in ("fp32", "fp32 compiled"):
            fns[f"{name} compiled"] = ours(f"{name} compiled", m, True)
    if llama is not None:
        fns[LLAMA_CPP] = lambda: outputs.setdefault(LLAMA_CPP, []).append(llama.greedy(prompt, new_tokens))
    for name in [n for n in fns if n.endswith("compiled")]:
        fns[name]()                                                        # compiles, once, outside the clock
    runs = interleaved_runs(fns, repeats=repeats, warmup=1, device=device)
    fastest = {name: min(range(repeats), key=t.__getitem__) for name, t in runs.items()}
    best = {name: outputs[name][-repeats + i] for name, i in fastest.items()}
    return Timed({name: new_tokens / runs[name][i] for name, i in fastest.items()},
                 {name: best[name].tpot_s for name in fns}, best,
                 {name: [new_tokens / s for s in seconds] for name, seconds in runs.items()})


def engine_rows(r: Result, name: str, int8, tok, prompt: str, batch: int) -> dict:
    """The engine's compiled int8 decode at `batch` against batch 1, and what `batch` rows cost its int8 kernel.

    `name` is "int8" (PyTorch's kernel) or "int8 (q8 kernel)": a faster kernel at one row can scale less with
    the batch, where its products at `batch` rows are bound by the CPU's multiplies, not by the weights' bytes.
    """
    key = "int8" if name == "int8" else "int8_q8"
    layer = int8.layers[0].mlp.fused.layer if int8.layers[0].mlp.fused else int8.layers[0].mlp.up_proj
    cost = rows_cost(layer, (1, batch))
    r.add(f"{name}{'' if name.endswith(Q8) else ' kernel'}, one MLP product",
          f"{batch} rows cost {cost[batch] / cost[1]:.1f}x one row ({cost[1] * 1e6:.0f} us for one)")
    one = decode_throughput(int8, tok, 1, new_tokens=32, prompt=prompt, compile=True)
    many = decode_throughput(int8, tok, batch, new_tokens=32, prompt=prompt, compile=True)
    r.add(f"engine, {name} compiled",
          f"batch {batch}: {many:.1f} decode tokens/s, {many / one:.2f}x batch 1 ({one:.1f})")
    return {f"{key}_rows_cost": {n: c / cost[1] for n, c in cost.items()},
            f"engine_{key}_compiled": {"batch_1": one, f"batch_{batch}": many, "scaling": many / one}}


def q8_rows(r: Result, models: dict, rows: tuple[int, ...] = (1, 2, 4, 8, 16)) -> dict:
    """One MLP product of each quantized model by rows: PyTorch's kernels against the hand-written one."""
    from ..cpu_q8 import Q8_MAX_ROWS
    found = {}
    for name in ("int8", "int4 g64"):
        if name not in models or name + Q8 not in models:
            continue
        mlp = [models[n].layers[0].mlp for n in (name, name + Q8)]
        cost = [rows_cost(m.fused.layer if m.fused else m.up_proj, rows) for m in mlp]
        ratio = {n: cost[1][n] / cost[0][n] for n in rows}
        r.add(f"{name}: q8 kernel / PyTorch's, one MLP product",
              ", ".join(f"{n} rows {v:.2f}x" for n, v in ratio.items())
              + f" (the q8 kernel takes calls of up to {Q8_MAX_ROWS[name.split()[0]]} rows)")
        found[name] = ratio
    return {"q8_rows_cost": found}


def llama_cpp_for(model_name: str) -> tuple[LlamaCpp | None, str | None]:
    """llama.cpp on the fetched model's own GGUF file, with this process's threads, where it is installed and
    decodes here; else None and why not, in one line."""
    why_not = llama_cpp_missing()
    if why_not is not None:
        return None, why_not
    from ..hub import REMOTE, gguf_file
    if model_name not in REMOTE:
        raise ValueError(f"llama.cpp runs the GGUF file a fetched model came from; --model {model_name!r} has none: "
                         f"use one of {sorted(REMOTE)}")
    gguf, threads = gguf_file(model_name), torch.get_num_threads()
    crash = llama_cpp_crash(gguf, threads)
    return (None, crash) if crash is not None else (LlamaCpp(gguf, threads=threads), None)


def llama_for(model_name: str, against: str | None) -> tuple[LlamaCpp | None, str | None]:
    """llama.cpp on the model's own GGUF file when asked for and usable; else None and why not (or None)."""
    return llama_cpp_for(model_name) if against == LLAMA_CPP else (None, None)


def contender_rows(r: Result, t: Timed, streamed: dict[str, int]) -> dict[str, dict]:
    """One row per contender (tokens/s, its ratio to fp32 eager and to llama.cpp, TPOT, bytes streamed, GB/s) and
    the same figures as values."""
    values = {}
    for name, rate in t.rate.items():
        gbs = streamed[name] / t.tpot[name] / 1e9
        vs = f", {rate / t.rate[LLAMA_CPP]:.2f}x llama.cpp" if LLAMA_CPP in t.rate and name != LLAMA_CPP else ""
        r.add(name, f"{rate:6.1f} tokens/s ({rate / t.rate['fp32']:.2f}x fp32 eager{vs}), TPOT {t.tpot[name] * 1e3:5.1f} "
                    f"ms, {streamed[name] / 2**20:5.1f} MiB streamed per token, {gbs:4.1f} GB/s")
        values[name] = {"tokens_per_s": rate, "tpot_s": t.tpot[name], "streamed_bytes": streamed[name],
                        "gb_per_s": gbs, "vs_fp32_eager": rate / t.rate["fp32"],
                        "vs_fp32_eager_by_round": t.ratios(name, "fp32")}
    return values


def lowering_rows(r: Result, models: dict) -> dict:
    """Per float precision that ran: the lowering its compiled step took here and each one's measured step."""
    from ..compiled import compile_model
    from ..lowering import LOWERING_NAMES
    values = {}
    for name in ("fp32", "bf16"):                         # the float precisions' steps, as time_contenders ran them
        if (model := models.get(f"{name} compiled", models.get(name))) is None:
            continue
        step = compile_model(model, verbose=False)
        ms = step.lowering_ms
        timed = " (" + ", ".join(f"{k} {v:.1f} ms a step" for k, v in ms.items()) + ", measured once here)" if ms else ""
        said = (f"none: compiling failed, so its steps ran eagerly ({step.failed})" if step.failed is not None
                else LOWERING_NAMES[step.lowering] + timed if step.lowering in LOWERING_NAMES
                else "none to choose on this device (CUDA graphs)")
        r.add(f"{name} compiled lowering", said)
        values[f"{name}_lowering"] = {"lowering": None if step.failed else step.lowering, "step_ms": ms}
    return values


def bench_overhead(model_name: str = "smollm2-135m", against: str | None = None, new_tokens: int = 64,
                   repeats: int = 3, prompt: str = DEFAULT_PROMPT, engine_batch: int = 8,
                   precisions: tuple[str, ...] | None = None) -> Result:
    """Eager vs compiled decoding per precision, the memory wall, the engine's compiled batch (int8, on each
    kernel), and llama.cpp."""
    from ..validate import choice
    choice("against", against, (*AGAINST, None))
    precisions = default_precisions() if precisions is None else precisions
    for p in precisions:
        choice("precision", p, PRECISIONS)
    device = get_device()
    llama, why_not = llama_for(model_name, against)
    models = contenders(model_name, device, precisions)
    _, tok = load_model(model_name, dtype=torch.float32, device=device)
    t = time_contenders(models, tok, prompt, new_tokens, repeats, device, llama)
    streamed = {name: weight_bytes(models[name.removesuffix(" compiled")]).streamed for name in t.rate
                if name != LLAMA_CPP}
    if llama is not None:
        streamed[LLAMA_CPP] = llama.weight_bytes
    bandwidth, matvec = measure_bandwidth_gbs(device=device), matvec_bandwidth_gbs(models["fp32"])
    bound = bandwidth * 1e9 / streamed["fp32"]                     # fp32 tokens/s if each step streamed at the probe
    r = Result("overhead: eager and compiled decoding against the memory wall, batch 1, greedy")
    r.add("model / prompt", f"{model_name}, {len(tok.encode(prompt))} prompt tokens, {new_tokens} new, "
                            f"{torch.get_num_threads()} threads; best of {repeats} interleaved rounds")
    r.add("memory bandwidth (copy probe)", f"{bandwidth:.1f} GB/s: fp32's weight-streaming bound {bound:.1f} tokens/s")
    r.add("one fp32 matrix-vector product", f"{matvec:.1f} GB/s (MKL, the largest weight as loaded): "
                                            f"{matvec * 1e9 / streamed['fp32']:.1f} tokens/s if every weight streamed so")
    values = {"bandwidth_gbs": bandwidth, "matvec_gbs": matvec, **contender_rows(r, t, streamed)}
    if repeats > 1:                       # the best of each is one number; how much a ratio moves between rounds
        r.add("x fp32 eager, round by round", "; ".join(
            f"{n} {min(t.ratios(n, 'fp32')):.2f}-{max(t.ratios(n, 'fp32')):.2f}x" for n in t.rate if n != "fp32"))
    measured = [n for n in PRECISIONS if n in models]
    for name in measured:
        values[name]["compiled_speedup"] = t.rate[f"{name} compiled"] / t.rate[name]
    r.add("compiled / eager", ", ".join(f"{n} {values[n]['compiled_speedup']:.2f}x" for n in measured))
    values.update(lowering_rows(r, models))
    r.add("fp32 compiled vs the bound", f"{t.rate['fp32 compiled'] / bound:.0%} of the copy probe's bound, "
          f"{t.rate['fp32 compiled'] / (matvec * 1e9 / streamed['fp32']):.0%} of the matvec ceiling")
    ref = t.best["fp32"].token_ids
    values["same_tokens"] = {n: t.best[n].token_ids == ref for n in t.rate if n != LLAMA_CPP}
    r.add("greedy tokens equal to fp32 eager's", ", ".join(f"{n} {'yes' if s else 'no'}"
                                                           for n, s in values["same_tokens"].items()))
    if llama is not None:
        theirs = t.best[LLAMA_CPP].token_ids
        shared = next((i for i, (a, b) in enumerate(zip(ref, theirs)) if a != b), min(len(ref), len(theirs)))
        r.add("llama.cpp's tokens", f"the first {shared} of {new_tokens} equal fp32's (its Q4_1 weights), "
                                    f"file {llama.path}")
        values["llama_matched_prefix"] = shared
    elif why_not is not None:
        r.add("llama.cpp", why_not)
    values.update(q8_rows(r, models))
    for name in ("int8", "int8" + Q8):
        if engine_batch > 1 and name in models:
            values.update(engine_rows(r, name, models[name], tok, prompt, engine_batch))
    r.values = values
    return r


@contextlib.contextmanager
def quiet_stderr():
    """Standard error silenced at the file-descriptor level: the profiler's C++ logger prints a line when it
    starts and stops (and, on a machine without a GPU, that it found none), which would land in the output."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def step_profile(model, compile: bool, steps: int = 4, context: int = 32, rows: int = 8) -> str:
    """Where one batch-1 decode step's time goes: the profiler's table of its `rows` costliest operations, over
    `steps` steps after `context` cached positions, eager or through the compiled graph (compiled once first)."""
    from torch.profiler import ProfilerActivity, profile
    from ..compiled import StaticKVCache, compile_model, static_capacity
    device = next(model.parameters()).device
    cache = StaticKVCache.for_model(model, 1, static_capacity(model, context + steps + 1))   # generate's shape
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    compiled = compile_model(model) if compile else None

    def step(pos: int):
        at = torch.tensor([pos], device=device)
        return compiled.step(token, at, cache.layers) if compile else model(token, at, cache)

    with torch.inference_mode():
        for pos in range(2):
            step(pos)                                                   # compiles (once) and warms up
        with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for pos in range(context, context + steps):
                step(pos)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48)
    return f"{'compiled' if compile else 'eager'}, {steps} steps:\n{table}"
