"""A compiled decode step: the per-token overhead of eager PyTorch removed (gpt-fast's lesson).

An eager decode step runs about fifteen small operations per layer, each a Python call and a
dispatch, and on a CPU MKL's one-row matrix product streams a weight well below the memory's
speed. `torch.compile` traces one decoder layer into one graph that inductor turns into fused
C++ loops (CPU) or Triton kernels replayed as CUDA graphs (GPU, `mode="reduce-overhead"`).
Every layer has the same shapes, so all of a model's layers share one compiled graph: it
compiles once, in seconds, then the step runs layer after layer through it.

Shapes are static (gpt-fast's pattern): the cache holds a fixed number of positions,
preallocated, and every step writes its keys at `input_pos` and attends over all positions
with a mask, so one graph serves every position of a request. On a CPU a one-row product of
float weights goes one of two ways, whichever is faster on the machine: a reduction that inductor
writes itself, over row-major weights, or MKL's product, over column-major ones (eager code's
layout). Which one is faster depends on the processor (the reduction on an AMD EPYC, MKL on an
Intel Xeon, in the course's runs), so `choose_lowering` (lowering.py) times one compiled step each way, once per
machine and model shape, and keeps the answer in the user cache. The quantized layers call their
own kernels from inside the graph.

Compiled tokens follow the rule of exactness.py: the graph sums in another order than eager
code, so in fp32 they agree with eager decoding up to rounding ties, and in bf16 and the
quantized paths agreement is measured. A machine where compiling fails (no C++ compiler, an
unsupported op) decodes eagerly and says why, once.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import statistics
import time
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_q8
from .kv_cache import KVCache, cache_slots
from .lowering import LOWERING_NAMES, LOWERINGS, Verdict, float_linears, keep_verdict, lay_out_for, read_verdict

aten = torch.ops.aten
REDUCTION_MAX_ROWS = 1   # products of up to this many rows run as inductor's reduction on a CPU (one token, batch 1)
CAPACITY_STEP = 128      # a request's cache is rounded up to a multiple of this: nearby lengths share one graph
RECOMPILE_LIMIT = 256    # graphs dynamo keeps per compiled function (its default, 8, is met within one notebook)


# -- the CPU lowering of a one-row product --------------------------------------------------------
def _reduction_mm(a: Tensor, b: Tensor):
    """a [M, K] @ b [K, N] as a multiply-and-sum inductor fuses into one pass over b, where b is a row-major
    weight transposed (b.stride(0) == 1) and M is small; NotImplemented leaves the product to MKL."""
    if a.device.type != "cpu" or a.shape[0] > REDUCTION_MAX_ROWS or b.stride(0) != 1 \
            or a.dtype not in (torch.float32, torch.bfloat16) or b.dtype != a.dtype:
        return NotImplemented
    return (a[:, None, :].float() * b.t()[None].float()).sum(-1).to(a.dtype)          # (M, N), summed in fp32


def _reduction_addmm(bias: Tensor, a: Tensor, b: Tensor, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        return NotImplemented
    y = _reduction_mm(a, b)
    return NotImplemented if y is NotImplemented else y + bias


class _Decompositions(dict):
    """cpu_backend's decomposition table. Inductor pickles it into the key of its on-disk cache of compiled
    graphs, and many stock entries are C++ functions that pickle cannot take: every graph then compiled afresh,
    in every process. This table pickles as the call that rebuilds it."""

    def __reduce__(self):
        return _cpu_decompositions, ()


@functools.cache
def _cpu_decompositions() -> _Decompositions:
    from torch._inductor.decomposition import select_decomp_table
    return _Decompositions({**select_decomp_table(), aten.mm.default: _reduction_mm,
                            aten.addmm.default: _reduction_addmm})


@functools.cache
def _lowering_mark():
    """A graph pass that changes nothing and names this lowering (a hash of its source) to inductor's caches,
    which key a pass by its uuid but do not read the decomposition table: without it, a graph compiled with
    inductor's own table and one with ours would share a cache entry. None where torch has no custom passes or
    the source cannot be read: cpu_backend then passes the table as a plain dict, which cannot be pickled, and
    inductor compiles afresh."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
        source = "".join(inspect.getsource(f) for f in (_reduction_mm, _reduction_addmm, cpu_backend))
    except (ImportError, OSError):                       # OSError: no source to hash (an install without .py files)
        return None
    key = hashlib.sha256(source.encode()).hexdigest()

    class LoweringMark(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return f"infopt-lab reduction of products up to {REDUCTION_MAX_ROWS} rows, {key}"

    return LoweringMark()


def cpu_backend(gm, example_inputs):
    """Inductor with one-row float products lowered to its own reduction (the C++ backend).

    Without the graph's own size asserts: its Python wrapper would check every input's sizes and strides, which
    dynamo's guards have already checked before the call, and every quantized product's output against its
    fake, which tests/test_cpu_q8.py holds to the kernel. On SmolLM2 (about 490 inputs, 121 products) the
    checks cost about a millisecond of each decode step (`infopt-lab bench --only overhead` shows the step)."""
    from torch._inductor.compile_fx import compile_fx
    mark = _lowering_mark()
    if mark is None:
        return compile_fx(gm, example_inputs, decompositions=dict(_cpu_decompositions()),   # a plain dict
                          config_patches={"size_asserts": False})
    return compile_fx(gm, example_inputs, decompositions=_cpu_decompositions(),
                      config_patches={"post_grad_custom_post_pass": mark, "size_asserts": False})


def mkl_backend(gm, example_inputs):
    """Inductor with its own decompositions: a float product stays a call to MKL, over the weights as eager code
    lays them out (column-major). Size asserts off, as in cpu_backend."""
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs, config_patches={"size_asserts": False})


def compile_options(device: torch.device, lowering: str | None = None) -> dict:
    """torch.compile's backend and mode for a device: CUDA graphs on CUDA; elsewhere inductor's C++, with the
    one-row float products lowered to inductor's reduction (cpu_backend, also where there are none: None) or
    left to MKL (mkl_backend)."""
    if device.type == "cuda":
        return dict(backend="inductor", mode="reduce-overhead")
    return dict(backend=mkl_backend if lowering == "mkl" else cpu_backend)


# -- the static cache --------------------------------------------------------------------------------
class StaticLayer:
    """One layer of a static cache: k, v [B, H_kv, S, D]. Writes at `input_pos`, attends over all S under a mask."""

    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v = k, v

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        # q: [B, H, T, D]; k, v: [B, H_kv, T, D]; input_pos: [T] (a tensor, never read into Python)
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        keys = torch.arange(self.k.shape[2], device=q.device)
        mask = keys[None, :] <= input_pos[:, None]                                      # (T, S)
        if q.device.type == "cpu" and q.shape[2] == 1 and torch.compiler.is_compiling():
            if q.dtype == self.k.dtype == torch.float32 and cpu_q8.native_loaded():
                return torch.ops.infopt.one_query_attention(q, self.k, self.v, input_pos)   # kernels/attention.c
            return self._one_query(q, mask[0])
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask,
                                              enable_gqa=q.shape[1] != self.k.shape[1])

    def _one_query(self, q: Tensor, visible: Tensor) -> Tensor:
        """One new token's attention in a compiled CPU step, as products, a softmax and sums that inductor fuses
        into loops of its own: PyTorch's attention kernel has a fixed cost per call far above one query's work
        (`bench.overhead.step_profile` shows it). Query heads share their key head in groups, as enable_gqa does;
        summed in fp32. Eager steps keep PyTorch's kernel. In fp32, where the C++ operators load, the step calls
        infopt::one_query_attention instead: kernels/attention.c reads only the visible positions, where these
        loops run over the whole cache."""
        B, H, _, D = q.shape
        h_kv = self.k.shape[1]
        qg = q.reshape(B, h_kv, H // h_kv, 1, D).float()                            # (B, H_kv, g, 1, D)
        scores = (qg * self.k[:, :, None].float()).sum(-1) * (1.0 / math.sqrt(D))    # (B, H_kv, g, S)
        p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out = (p[..., None] * self.v[:, :, None].float()).sum(-2)                     # (B, H_kv, g, D)
        return out.reshape(B, H, 1, D).to(q.dtype)


class StaticKVCache(KVCache):
    """A contiguous cache whose every call attends over all `max_seq_len` positions under a mask: one shape per
    request length bucket, so a compiled step never recompiles as the request grows (gpt-fast's KV cache)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layers = [StaticLayer(self.k[i], self.v[i]) for i in range(self.k.shape[0])]
        if self.k.device.type == "cuda":          # written in place by every step: CUDA graphs keep their address
            for t in (self.k, self.v):
                torch._dynamo.mark_static_address(t)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        cache_slots(input_pos, k.shape[2], self.max_seq_len)          # eager calls only: checks the positions
        return self.layers[layer].attend(layer, q, k, v, input_pos)


def static_capacity(model, positions: int) -> int:
    """Cache positions for a request of `positions` tokens: rounded up to CAPACITY_STEP, within the context."""
    limit = model.config.max_seq_len
    return min(limit, -(-positions // CAPACITY_STEP) * CAPACITY_STEP) if positions <= limit else positions


# -- the compiled model ------------------------------------------------------------------------------
# A region dynamo traces once and every call reuses (invoke_subgraph): the stack of identical layers compiles
# like one layer, and the whole step is one compiled call with one guard check (torch >= 2.8; older torch
# inlines every layer: the same graph, compiled for longer).
_region = getattr(torch.compiler, "nested_compile_region", lambda fn: fn)


@_region
def _run_block(block: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, cache) -> Tensor:
    return block(x, cos, sin, input_pos, cache)


def _run_stack(model: nn.Module, ids: Tensor, input_pos: Tensor, layers, hidden: bool = False):
    """ids [B, T] at positions [T] -> logits [B, T, V], layer i attending through layers[i]; with `hidden`,
    (logits, the last hidden states [B, T, C]) (what a feature draft reads)."""
    x = model.embed_tokens(ids)                                                     # (B, T, C)
    cos, sin = model.rope(input_pos)
    for block, cache in zip(model.layers, layers):
        x = _run_block(block, x, cos, sin, input_pos, cache)
    return (model.logits(x), x) if hidden else model.logits(x)


def compile_failure(error: BaseException) -> str:
    """One line on why compiling failed: the error's first line, without inductor's long advice (a failing
    backend's own error, where dynamo wraps it)."""
    error = getattr(error, "inner_exception", None) or error
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


class CompiledModel:
    """A model's decode step through `torch.compile`, shared by every static-shape step run with it.

    `step(ids, input_pos, layers)` runs ids [B, T] at positions [T] through the embedding, every layer
    (layer i attending through `layers[i]`, anything with the attention contract) and the head as one
    compiled call; it returns the logits of every position [B, T, V]. The first call of a shape compiles,
    saying so before and printing the seconds it took after; `failed` holds why, where compiling failed and
    the steps run eagerly.
    """

    def __init__(self, model: nn.Module, verbose: bool = True, lowering: str | None = None):
        self.model, self.verbose, self.lowering = model, verbose, lowering
        self.lowering_ms: dict[str, float] = {}      # a step's time under each lowering, where they were measured
        self.device = next(model.parameters()).device
        self.failed: str | None = None
        self.compile_s: dict[tuple, float] = {}     # shape -> seconds its first (compiling) call took
        # one graph per model shape, batch bucket and precision: a course run meets dozens, more than dynamo's
        # default limit of 8 before it silently stops compiling
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"   # torch < 2.7
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        self._step = torch.compile(_run_stack, dynamic=False, **compile_options(self.device, lowering))

    @property
    def backend(self) -> str:
        """What compiles the step here, in words."""
        if self.device.type == "cuda":
            return "inductor + CUDA graphs"
        return "inductor's C++ backend" + (", float products on MKL" if self.lowering == "mkl" else "")

    @torch.inference_mode()
    def step(self, ids: Tensor, input_pos: Tensor, layers, hidden: bool = False):
        """Logits [B, T, V] of ids [B, T] at positions input_pos [T], each layer attending through `layers[i]`;
        with `hidden=True`, (logits, last hidden states [B, T, C]), compiled as a graph of its own."""
        from .model import freeze_fusions
        if self.failed is not None:
            return _run_stack(self.model, ids, input_pos, layers, hidden)
        key = (tuple(ids.shape), type(layers[0]).__name__, layers[0].k.shape, hidden)
        first = key not in self.compile_s
        if first:
            freeze_fusions(self.model)
            if self.device.type == "cpu":
                cpu_q8.native_why_not()              # the C++ operators built and loaded before the trace reads them
            # inductor's C++ backend warns, on a machine without CUDA, that it found no CUDA runtime
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
            if self.verbose:
                print(f"compiling the decode step for {ids.shape[0]} x {ids.shape[1]} tokens ({self.backend}; "
                      "once per shape, seconds to a minute)...", flush=True)
            start = time.perf_counter()
        try:
            out = self._step(self.model, ids, input_pos, layers, hidden)
        except Exception as e:                      # a compiler missing or failing here: decode eagerly
            self.failed = compile_failure(e)
            print(f"torch.compile failed here ({self.failed}); decoding eagerly", flush=True)
            return _run_stack(self.model, ids, input_pos, layers, hidden)
        if first:
            self.compile_s[key] = time.perf_counter() - start
            if self.verbose:
                print(f"compiled in {self.compile_s[key]:.1f} s", flush=True)
        return out


# -- which lowering, per machine (lowering.py keeps the verdicts) ----------------------------------------
def step_ms(compiled: CompiledModel, steps: int = 8, warm: int = 2) -> float:
    """The median milliseconds of a compiled one-token step at batch 1, each at the next position (compiled during
    the untimed warm-up). Its own clock: timing.py's helpers import generate.py, which imports this module."""
    cache = StaticKVCache.for_model(compiled.model, 1, CAPACITY_STEP)
    ids, times = torch.tensor([[1]], device=compiled.device), []
    for pos in range(warm + steps):
        start = time.perf_counter()
        compiled.step(ids, torch.tensor([pos], device=compiled.device), cache.layers)
        if pos >= warm:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_lowerings(model: nn.Module) -> tuple[dict[str, float], CompiledModel]:
    """One compiled step's median time under each lowering, the model re-laid for each in turn (reduction first,
    so that a model loaded column-major ends in eager code's layout when MKL wins), and the last one's
    CompiledModel."""
    times, compiled = {}, None
    for lowering in LOWERINGS:
        lay_out_for(model, lowering)
        compiled = CompiledModel(model, verbose=False, lowering=lowering)
        times[lowering] = step_ms(compiled)
        if compiled.failed:                                  # said once, by the step; it decodes eagerly
            break
    return times, compiled


def choose_lowering(model: nn.Module, verbose: bool = True) -> tuple[Verdict | None, CompiledModel | None]:
    """The faster lowering of a float model's one-row products on this machine: lowering.py's kept verdict, or
    measured now (two compiles and a few steps, once per machine and model shape) and kept. Also the
    measurement's last CompiledModel, where it measured now (None otherwise); where compiling failed, no
    verdict and that CompiledModel, which decodes eagerly."""
    verdict = read_verdict(model)
    if verdict is not None:
        return verdict, None
    if verbose:
        print("compile: timing one decode step with each lowering of the float products (inductor's reduction, "
              "MKL), once on this machine...", flush=True)
    times, last = measure_lowerings(model)
    if last.failed:
        return None, last
    verdict = keep_verdict(model, times)
    if verbose:
        other = next(k for k in LOWERINGS if k != verdict.lowering)
        print(f"compile: {LOWERING_NAMES[verdict.lowering]} is the faster here ({times[verdict.lowering]:.1f} ms a "
              f"step against {times[other]:.1f} ms); kept in the user cache for this machine", flush=True)
    return verdict, last


_COMPILED: "weakref.WeakKeyDictionary[nn.Module, CompiledModel]" = weakref.WeakKeyDictionary()


def compile_model(model: nn.Module, verbose: bool = True, lowering: str = "auto") -> CompiledModel:
    """The model's CompiledModel, made once per model and kept while the model lives.

    `lowering` ("auto", "reduction" or "mkl") says how a CPU step computes a float model's one-row products:
    "auto" takes the faster here (`choose_lowering`: measured once per machine and model shape, then read
    from the user cache). The model's linear weights are re-laid in place for the lowering (row-major for the
    reduction, column-major for MKL, fused again); eager steps read either layout. Elsewhere (CUDA, or a model
    without float products) there is nothing to choose. A model keeps the lowering it was first compiled with.
    """
    from .model import Transformer
    if not isinstance(model, Transformer):
        raise TypeError(f"compile=True needs the package's Transformer (lab.load_model), got {type(model).__name__}")
    if lowering not in ("auto", *LOWERINGS):
        raise ValueError(f"lowering must be 'auto', 'reduction' or 'mkl', got {lowering!r}")
    compiled = _COMPILED.get(model)
    if compiled is None:
        p = next(model.parameters())
        if p.device.type != "cpu" or not float_linears(model):
            compiled = CompiledModel(model, verbose)
        else:
            ms, measured = {}, None
            if lowering == "auto":
                verdict, measured = choose_lowering(model, verbose)
                if verdict is None:                              # compiling failed: measured decodes eagerly
                    _COMPILED[model] = measured
                    return measured
                lowering, ms = verdict.lowering, verdict.step_ms
            lay_out_for(model, lowering)
            if measured is not None and measured.lowering == lowering:
                compiled = measured                              # the measurement's graph, already compiled
                compiled.verbose = verbose
            else:
                compiled = CompiledModel(model, verbose, lowering)
            compiled.lowering_ms = ms
        _COMPILED[model] = compiled
    compiled.verbose = verbose
    return compiled
