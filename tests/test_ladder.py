"""The ladder: every rung serves the same workload; scheduling rungs keep the tokens; JSON as specified."""
import json

import pytest

from infopt_lab.bench.decision import cost_per_million_tokens, gpu_estimate
from infopt_lab.bench.ladder import RUNG_NAMES, ladder_command

TINY = dict(sessions=2, turns=2, system_tokens=32, new_tokens=4, max_batch_size=2, combined_batch_size=2, k=2,
            ppl_tokens=256)


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    path = tmp_path_factory.mktemp("ladder") / "ladder.json"
    rungs = ladder_command("target", str(path), 0.10, progress=None, **TINY)
    return rungs, path


def test_every_rung_serves_the_workload_and_scheduling_keeps_the_tokens(ladder):
    rungs, _ = ladder
    assert [r.name for r in rungs] == list(RUNG_NAMES)
    assert all(len(r.outputs) == 4 and r.throughput_tok_s > 0 and r.peak_memory_bytes > 0 for r in rungs)
    ours = rungs[1].outputs                       # our decoding; batching, speculation and caching only schedule
    assert rungs[2].outputs == ours and rungs[4].outputs == ours and rungs[5].outputs == ours
    assert rungs[1].ppl_delta_pct == rungs[5].ppl_delta_pct == 0.0
    assert rungs[3].ppl_delta_pct == rungs[6].ppl_delta_pct != 0.0
    assert rungs[3].peak_memory_bytes < rungs[2].peak_memory_bytes       # int8 weights and KV are counted smaller


def test_the_json_has_the_rungs_in_order_and_a_plot_beside_it(ladder):
    _, path = ladder
    data = json.loads(path.read_text())
    assert [r["name"] for r in data["rungs"]] == list(RUNG_NAMES)
    assert set(data["rungs"][0]) == {"name", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_s",
                                     "peak_memory_bytes", "ppl_delta_pct", "exact_match", "settings"}
    assert "cascade attention" in data["rungs"][-1]["settings"] and "prompt lookup" in data["rungs"][4]["settings"]
    assert path.with_suffix(".png").stat().st_size > 0 and data["gpu_estimates"]


def test_prices_and_gpu_estimates():
    assert cost_per_million_tokens(1e6 / 3600, 2.0) == pytest.approx(2.0)    # a million tokens an hour
    with pytest.raises(ValueError):
        cost_per_million_tokens(0.0, 1.0)
    memory_bound = gpu_estimate(1e9, 1, bandwidth_gbs=1000, peak_tflops=1000)
    assert memory_bound == pytest.approx(1000 / 2)                          # 2 GB of bf16 weights per step
    assert gpu_estimate(1e9, 10_000, 1000, 1000) < 10_000 * memory_bound     # compute-bound at a huge batch


def test_ablation_removes_one_choice_at_a_time_and_the_smaller_model_is_scored_against_the_full_one():
    import infopt_lab as lab
    from infopt_lab.bench.ablation import ABLATIONS, ablation, smaller_model_rung
    from infopt_lab.bench.ladder import served_by_engine
    from infopt_lab.workloads import agentic_workload
    model, tok = lab.load_model("target")
    small, _ = lab.load_model("draft")
    w = agentic_workload(tok, sessions=2, turns=1, system_tokens=48, new_tokens=4)
    reference = served_by_engine("ref", lab.Engine(model, tok, max_batch_size=4, max_model_len=w.max_seq_tokens),
                                 w).token_ids
    rows = ablation(model, tok, w, reference, int8_delta=1.5)
    assert [r.name for r in rows] == ["all combined"] + [f"without {name}" for name in ABLATIONS]
    combined, no_int8, no_spec, no_prefix, batch8 = rows
    assert "int8 weights, int8 KV" in combined.settings and "cascade attention" in combined.settings
    assert "fp32 weights, fp32 KV" in no_int8.settings and no_int8.ppl_delta_pct == 0.0
    assert no_int8.exact_match == 1.0                  # fp32, greedy, scheduling only: the reference's tokens
    assert "speculation" not in no_spec.settings and no_spec.ppl_delta_pct == 1.5
    assert "prefix caching" not in no_prefix.settings and "cascade" not in no_prefix.settings
    assert batch8.settings.startswith("engine, batch 8") and combined.settings.startswith("engine, batch 16")
    row = smaller_model_rung(model, small, tok, w, reference, ppl_tokens=256, max_batch_size=4)
    assert row.settings.startswith(f"{small.num_parameters() / 1e6:.1f}M parameters instead of")
    assert row.ppl_delta_pct > 0 and 0 <= row.exact_match <= 1
