"""The compiled decode step (compiled.py): the same tokens as eager decoding by the rule of exactness, in generate
and in the engine, on the bundled target with small shapes; eager, saying why, where compiling fails."""
import pytest
import torch

import infopt_lab as lab
from infopt_lab import compiled as compiled_mod
from infopt_lab import lowering as lowering_mod
from infopt_lab.bench.exactness import heldout_prompts
from infopt_lab.compiled import StaticKVCache, static_capacity
from infopt_lab.engine.model_runner import batch_buckets as batch_buckets_for
from infopt_lab.exactness import compare
from infopt_lab.quantize import QuantEmbedding, weight_bytes
from test_engine import PROMPTS

NEW = 24


@pytest.fixture(scope="module")
def target():
    return lab.load_model("target", dtype=torch.float32)


def greedy(model, tok, prompts, compile, new=NEW, **kw):
    return [lab.generate(model, tok, p, max_new_tokens=new, compile=compile, **kw).token_ids for p in prompts]


def test_compiled_generate_follows_the_rule_on_heldout_prompts_and_stops_where_eager_stops(target):
    """fp32: identical to eager decoding except at rounding ties, on prompts nobody tuned, and a stop token
    (a newline: the bundled model rarely writes EOS) ends each request at the same place."""
    model, tok = target
    prompts = heldout_prompts(tok, 6, seed=5) + PROMPTS[:2]
    newline = tok.encode("\n", add_special_tokens=False)
    for kw in (dict(stop_at_eos=False), dict(stop_token_ids=newline)):
        eager = greedy(model, tok, prompts, compile=False, new=48, **kw)
        compiled = greedy(model, tok, prompts, compile=True, new=48, **kw)
        agreement = compare(model, [tok.encode(p) for p in prompts], eager, compiled)
        assert agreement.holds, agreement.summary(tok)
    assert sum(len(ids) < 48 for ids in eager) >= 2                               # stopped early
    assert lab.compiled.compile_model(model).compile_s                             # it really compiled


def test_the_compiled_engine_decodes_what_the_eager_engine_does(target):
    model, tok = target
    prompts = PROMPTS[:5]
    runs = {}
    for compile in (False, True):
        engine = lab.Engine(model, tok, max_batch_size=4, max_model_len=96, compile=compile)
        outs = engine.generate(prompts, max_new_tokens=[20, 6, 14, 20, 9], stop_at_eos=False)
        runs[compile] = ([o.token_ids for o in outs], outs.stats.decode_attention["target"])
    assert runs[True][1].get("compiled", 0) > 0 and "compiled" not in runs[False][1]
    agreement = compare(model, [tok.encode(p) for p in prompts], runs[False][0], runs[True][0])
    assert agreement.holds, agreement.summary(tok)


def test_quantized_compiled_steps_stay_within_the_kernels_rounding(target):
    """int8 and int4: agreement is measured, not promised (the rule); one step's logits sit within bf16 rounding."""
    model, tok = target
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    for scheme, g in (("int8", None), ("int4", 32)):
        q = lab.quantize_model(model, scheme, group_size=g)
        step = lab.compiled.compile_model(q, verbose=False)
        cache = StaticKVCache.for_model(q, 1, 128)
        eager_cache = StaticKVCache.for_model(q, 1, 128)
        T = ids.shape[1]
        with torch.inference_mode():
            q(ids, torch.arange(T), cache), q(ids, torch.arange(T), eager_cache)
            nxt = torch.tensor([[5]])
            got = step.step(nxt, torch.tensor([T]), cache.layers)[0, -1]
            want = q(nxt, torch.tensor([T]), eager_cache)[0, -1]
        assert (got - want).abs().max() < 0.05 * want.abs().max(), scheme
        assert got.argmax() == want.argmax()


@pytest.mark.parametrize("lowering", compiled_mod.LOWERINGS)
def test_each_lowering_follows_the_rule_and_lays_the_weights_out_for_itself(lowering):
    """The reduction over row-major weights and MKL over column-major ones: each compiled step decodes what eager
    decoding does, up to rounding ties, on held-out prompts; eager steps read either layout."""
    model, tok = lab.load_model("target", dtype=torch.float32)                      # a model of its own
    prompts = heldout_prompts(tok, 4, seed=31)
    eager = greedy(model, tok, prompts, compile=False, new=32)
    step = compiled_mod.compile_model(model, verbose=False, lowering=lowering)
    assert step.lowering == lowering
    assert lab.model.weight_layout(model) == ("row" if lowering == "reduction" else "column")
    compiled = greedy(model, tok, prompts, compile=True, new=32)
    agreement = compare(model, [tok.encode(p) for p in prompts], eager, compiled)
    assert agreement.holds, agreement.summary(tok)
    assert greedy(model, tok, prompts, compile=False, new=32) == eager             # eager, re-laid: the same


@pytest.mark.parametrize("faster", compiled_mod.LOWERINGS)
def test_auto_takes_the_faster_lowering_measures_it_once_per_machine_and_keeps_it(tiny, faster, tmp_path,
                                                                                 monkeypatch, capsys):
    import copy
    import json
    monkeypatch.setenv("INFOPT_LAB_CACHE", str(tmp_path))
    measured = []
    times = {faster: 1.0, next(k for k in compiled_mod.LOWERINGS if k != faster): 3.0}

    def fake_step_ms(compiled, **kw):                       # the real step, compiled and run; the clock faked
        compiled.step(torch.tensor([[1]]), torch.tensor([0]), StaticKVCache.for_model(compiled.model, 1, 128).layers)
        measured.append(compiled.lowering)
        return times[compiled.lowering]
    monkeypatch.setattr(compiled_mod, "step_ms", fake_step_ms)
    model = copy.deepcopy(tiny[0])
    step = compiled_mod.compile_model(model)
    assert step.lowering == faster and step.lowering_ms == times and sorted(measured) == sorted(times)
    assert lab.model.weight_layout(model) == ("row" if faster == "reduction" else "column")
    assert f"{lowering_mod.LOWERING_NAMES[faster]} is the faster here (1.0 ms a step against 3.0 ms)" in \
        capsys.readouterr().out
    kept = json.loads((tmp_path / lowering_mod.LOWERING_FILE).read_text())
    assert kept == {lowering_mod.lowering_key(model): {"lowering": faster, "step_ms": times}}

    again = compiled_mod.compile_model(copy.deepcopy(tiny[0]))      # the same shapes: read back, not measured
    assert again.lowering == faster and len(measured) == 2 and "timing" not in capsys.readouterr().out
    (tmp_path / lowering_mod.LOWERING_FILE).write_text("{not json")    # a damaged file: measured again
    assert compiled_mod.compile_model(copy.deepcopy(tiny[0])).lowering == faster and len(measured) == 4
    with pytest.raises(ValueError, match="'auto', 'reduction' or 'mkl'"):
        compiled_mod.compile_model(copy.deepcopy(tiny[0]), lowering="fast")


def test_a_failing_compiler_decodes_eagerly_and_says_why(target, monkeypatch, capsys):
    model, tok = target
    eager = greedy(model, tok, PROMPTS[:1], compile=False)
    q = lab.quantize_model(model, "int8")          # a model of its own: a fresh CompiledModel

    def broken(gm, example_inputs):
        raise RuntimeError("no C++ compiler found")
    monkeypatch.setattr(compiled_mod, "compile_options", lambda device, lowering=None: dict(backend=broken))
    got = greedy(q, tok, PROMPTS[:1], compile=True)
    out = capsys.readouterr().out
    assert out.count("torch.compile failed here (") == 1 and "no C++ compiler found" in out
    assert out.count("decoding eagerly") == 1 and lab.compiled.compile_model(q).failed
    assert got == greedy(q, tok, PROMPTS[:1], compile=False)
    assert len(eager[0]) == len(got[0])


def test_bad_combinations_are_refused(target):
    model, tok = target
    with pytest.raises(ValueError, match="batch_invariant=True"):
        lab.generate(model, tok, "x", max_new_tokens=2, compile=True, batch_invariant=True)
    with pytest.raises(ValueError, match="use_cache=False"):
        lab.generate(model, tok, "x", max_new_tokens=2, compile=True, use_cache=False)
    with pytest.raises((TypeError, ValueError), match="compile"):
        lab.generate(model, tok, "x", max_new_tokens=2, compile="yes")
    with pytest.raises(ValueError, match="batch_invariant=True"):
        lab.Engine(model, tok, compile=True, batch_invariant=True)
    with pytest.raises(TypeError, match="Transformer"):
        lab.compiled.compile_model(torch.nn.Linear(2, 2))


def test_the_static_cache_shapes():
    assert batch_buckets_for(8) == [1, 2, 4, 8] and batch_buckets_for(6) == [1, 2, 4, 6]
    assert batch_buckets_for(1) == [1]


def test_static_capacity_rounds_up_within_the_context(target):
    model, _ = target
    assert static_capacity(model, 1) == 128 and static_capacity(model, 129) == 256
    assert static_capacity(model, model.config.max_seq_len) == model.config.max_seq_len
    cache = StaticKVCache.for_model(model, 1, 4)
    with pytest.raises(ValueError, match="past the cache's 4 slots"):
        model(torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5), cache)


def test_a_quantized_tied_embedding_reads_the_heads_integers(target):
    model, tok = target
    ids = torch.tensor([tok.encode(PROMPTS[1])])
    before = weight_bytes(model)
    for scheme, g, tol in (("int8", None, 0.02), ("int4", 32, 0.2)):
        q = lab.quantize_model(model, scheme, group_size=g)
        assert isinstance(q.embed_tokens, QuantEmbedding) and q.embed_tokens.head is q.lm_head
        assert not any(p.numel() == model.embed_tokens.weight.numel() for p in q.parameters())   # no float table
        rows = q.embed_tokens(ids)[0]                                                         # (T, C)
        assert torch.equal(rows, q.lm_head.dequantized_weight()[ids[0]])
        want = model.embed_tokens(ids)[0]
        assert (rows - want).abs().max() <= tol * want.abs().max()
        after = weight_bytes(q)
        assert after.stored < before.stored / (3 if scheme == "int8" else 5)
        assert after.streamed < before.streamed


def test_smollm2_compiled_follows_the_rule():
    """The real model, fp32: compiled decoding equals eager decoding on held-out prompts except at rounding ties."""
    model, tok = lab.load_model("smollm2-135m", dtype=torch.float32)
    prompts = heldout_prompts(tok, 4, seed=28)
    eager = greedy(model, tok, prompts, compile=False, new=32)
    compiled = greedy(model, tok, prompts, compile=True, new=32)
    assert any(len(ids) < 32 for ids in eager)                                     # a chat answer ends at EOS
    agreement = compare(model, [tok.encode(p) for p in prompts], eager, compiled)
    assert agreement.holds, agreement.summary(tok)


def test_the_overhead_rung_measures_every_precision_and_says_how_to_get_llama_cpp(monkeypatch):
    from infopt_lab.bench import overhead
    monkeypatch.setattr(overhead, "llama_cpp_missing", lambda: "llama-cpp-python is not installed: pip install x")
    from infopt_lab.cpu_q8 import available
    q8 = ("int8" + overhead.Q8,) if available() else ()
    r = overhead.bench_overhead("target", against="llama.cpp", new_tokens=4, repeats=1, engine_batch=2,
                                precisions=("fp32", "int8", *q8))
    text = r.render()
    for name in ("fp32", "int8", *q8):
        assert r.values[name]["tokens_per_s"] > 0 and r.values[f"{name} compiled"]["streamed_bytes"] > 0
        assert r.values[name]["compiled_speedup"] > 0
        assert len(r.values[f"{name} compiled"]["vs_fp32_eager_by_round"]) == 1       # repeats=1: one round
    assert "round by round" not in text                                                # no spread in one round
    assert r.values["int8"]["streamed_bytes"] < r.values["fp32"]["streamed_bytes"] / 3
    assert "llama-cpp-python is not installed: pip install x" in text and "llama.cpp" not in r.values
    assert r.values["engine_int8_compiled"]["scaling"] > 0 and set(r.values["int8_rows_cost"]) == {1, 2}
    if q8:                                                         # the engine on the hand-written kernel too
        assert r.values["engine_int8_q8_compiled"]["scaling"] > 0 and set(r.values["int8_q8_rows_cost"]) == {1, 2}
        assert "engine, int8 (q8 kernel) compiled" in text
    assert set(r.values["q8_rows_cost"]) == ({"int8"} if q8 else set())
    assert all(v > 0 for ratios in r.values["q8_rows_cost"].values() for v in ratios.values())
    monkeypatch.setattr(overhead, "llama_cpp_missing", lambda: None)
    with pytest.raises(ValueError, match="GGUF"):
        overhead.bench_overhead("target", against="llama.cpp", new_tokens=2, repeats=1, engine_batch=0)
    with pytest.raises(ValueError, match="against"):
        overhead.bench_overhead("target", against="vllm")
    with pytest.raises(ValueError, match="precision"):
        overhead.bench_overhead("target", precisions=("fp8",))


def test_the_rung_names_each_float_precisions_lowering_with_its_measured_steps(monkeypatch):
    """fp32 and bf16 each have a lowering row (a CPU without bf16 instructions can make MKL's bf16 product many
    times slower, so bf16's choice can matter more than fp32's); a precision that did not run has none; a step
    with nothing to choose (CUDA), or whose compile failed, says so instead of naming a lowering."""
    from types import SimpleNamespace

    from infopt_lab.bench import overhead
    from infopt_lab.bench.result import Result
    steps = {"fp32c": SimpleNamespace(lowering="mkl", lowering_ms={"reduction": 58.5, "mkl": 55.3}, failed=None),
             "bf16": SimpleNamespace(lowering="reduction", lowering_ms={"reduction": 52.3, "mkl": 652.3}, failed=None),
             "gpu": SimpleNamespace(lowering=None, lowering_ms={}, failed=None),
             "broken": SimpleNamespace(lowering="mkl", lowering_ms={}, failed="no C++ compiler")}
    monkeypatch.setattr(compiled_mod, "compile_model", lambda model, verbose=True: steps[model])
    r = Result("rows")
    values = overhead.lowering_rows(r, {"fp32": "fp32e", "fp32 compiled": "fp32c", "bf16": "bf16", "int8": "x"})
    assert values == {"fp32_lowering": {"lowering": "mkl", "step_ms": steps["fp32c"].lowering_ms},
                      "bf16_lowering": {"lowering": "reduction", "step_ms": steps["bf16"].lowering_ms}}
    text = r.render()
    assert "fp32 compiled lowering" in text and "mkl 55.3 ms a step" in text
    assert "bf16 compiled lowering" in text and "mkl 652.3 ms a step" in text
    r = Result("rows")
    assert set(overhead.lowering_rows(r, {"fp32 compiled": "gpu"})) == {"fp32_lowering"}
    assert "none to choose on this device" in r.render() and "bf16" not in r.render()
    r = Result("rows")                            # compiling failed: no lowering named, the steps ran eagerly
    overhead.lowering_rows(r, {"bf16": "broken"})
    assert "compiling failed, so its steps ran eagerly (no C++ compiler)" in r.render()
    assert "MKL" not in r.render()


def test_round_by_round_ratios_pair_each_round_with_the_baselines_same_round():
    """A ratio is taken within a round (the contenders ran one after another), not best over best: a machine that
    slows for one round slows both sides of that round's ratio."""
    from infopt_lab.bench.overhead import Timed
    t = Timed({"a": 40.0, "b": 20.0}, {}, {}, {"a": [40.0, 20.0, 30.0], "b": [20.0, 10.0, 20.0]})
    assert t.ratios("a", "b") == [2.0, 2.0, 1.5] and t.ratios("b", "b") == [1.0, 1.0, 1.0]


def test_a_llama_cpp_build_that_crashes_is_left_out_with_its_cause_and_a_build_without_amx():
    """A build of llama.cpp whose instructions the machine refuses kills its process: the rung probes it in a child
    first and leaves it out, saying how it ended and (on an AMX CPU) how to build it without AMX."""
    import sys
    from infopt_lab.bench import overhead
    assert overhead.child_failure([sys.executable, "-c", "pass"]) is None
    killed = overhead.child_failure([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    assert killed == "killed by SIGSEGV"
    failed = overhead.child_failure([sys.executable, "-c", "raise SystemExit('no file')"])
    assert failed == "exit status 1: no file"
    hung = overhead.child_failure([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert hung == "stopped after 0.5 s without finishing"
    assert "mno-amx" not in overhead.llama_cmake_args(amx=False)
    with_amx = overhead.llama_cmake_args(amx=True)
    assert "-DGGML_NATIVE=ON" in with_amx and "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" in with_amx
    assert overhead.llama_cmake_args() in overhead.llama_install()


def test_a_compiled_step_is_read_back_from_inductors_cache_under_its_own_key(tiny, tmp_path, monkeypatch):
    """cpu_backend's graphs are cached on disk (compiling them again, in a fresh process or after a reset, reads
    the cache), and never share an entry with the same graph compiled by inductor's own table."""
    import copy
    import pickle

    from torch._dynamo.utils import counters
    pytest.importorskip("torch._inductor.custom_graph_pass")
    table = compiled_mod._cpu_decompositions()
    assert pickle.loads(pickle.dumps(table)) is table                       # pickles, as a call that rebuilds it
    mark = compiled_mod._lowering_mark()
    with monkeypatch.context() as m:
        m.setattr(compiled_mod, "REDUCTION_MAX_ROWS", 2)
        assert "up to 2 rows" in mark.uuid()                                # another lowering, another key

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))             # a cold cache of this test's own
    model, _ = tiny

    def one_step(**options):
        torch._dynamo.reset()                                               # forget compiled code: compile again
        m = copy.deepcopy(model)
        with monkeypatch.context() as patch:
            if options:
                patch.setattr(compiled_mod, "compile_options", lambda device, lowering=None: options)
            step = compiled_mod.compile_model(m, verbose=False, lowering="reduction")
        before = dict(counters["inductor"])
        logits = step.step(torch.tensor([[3]]), torch.tensor([4]), StaticKVCache.for_model(m, 1, 128).layers)
        counts = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
        return logits, counts

    plain, plain_counts = one_step(backend="inductor")
    first, first_counts = one_step()
    again, again_counts = one_step()
    torch._dynamo.reset()
    assert plain_counts == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}
    assert first_counts == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}          # not plain's entry
    assert again_counts == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0}
    assert torch.equal(first, again)
    assert torch.allclose(first, plain, atol=1e-4)


@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", [(6, 2, 40, torch.float32), (3, 3, 24, torch.float32),
                                                             (6, 3, 40, torch.bfloat16)])
@pytest.mark.parametrize("operator", [False, True], ids=["loops", "operator"])
def test_one_query_attention_in_a_compiled_step_equals_pytorchs_kernel(heads, kv_heads, head_dim, dtype, operator,
                                                                       monkeypatch):
    """The compiled CPU step's own one-token attention against the eager step's scaled_dot_product_attention, on
    grouped and plain heads, head sizes that are not powers of two, a half-filled cache, fp32 and bf16: inductor's
    loops, and in fp32 the C++ operator (kernels/attention.c) where it builds."""
    from infopt_lab import cpu_q8
    if operator and cpu_q8.native_why_not() is not None:
        pytest.skip(cpu_q8.native_why_not())
    monkeypatch.setattr(cpu_q8, "_LOADED", [operator])
    g = torch.Generator().manual_seed(heads * head_dim)
    S, filled = 16, 9
    k, v = (torch.randn(1, kv_heads, S, head_dim, generator=g).to(dtype) for _ in range(2))
    q, k_new, v_new = (torch.randn(1, h, 1, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    pos = torch.tensor([filled])

    def attend(layer, q, k_new, v_new, pos):
        return layer.attend(0, q, k_new, v_new, pos)

    graphs = []

    def backend(gm, example_inputs):                                    # traced, so the compiled branch runs
        graphs.append(str(gm.graph))
        return gm.forward

    traced = torch.compile(attend, backend=backend, fullgraph=True)
    got = traced(compiled_mod.StaticLayer(k.clone(), v.clone()), q, k_new, v_new, pos)
    assert ("one_query_attention" in graphs[0]) == (operator and dtype == torch.float32)
    want = attend(compiled_mod.StaticLayer(k.clone(), v.clone()), q, k_new, v_new, pos)
    torch._dynamo.reset()
    assert got.shape == want.shape == (1, heads, 1, head_dim) and got.dtype == dtype
    assert (got.float() - want.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
