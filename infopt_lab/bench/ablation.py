"""Notebook 07's last rungs: the combined rung with one choice removed at a time, and a smaller model as a rung.

All of them serve the workload `run_ladder` built and score against its rung 0's tokens, so their rows sit
beside the ladder's. None of it is a new mechanism: each is the engine with other settings.
"""
from __future__ import annotations

from .ladder import Rung, engine_settings, rung, served_by_engine

# what the combined rung is without one of its choices (cascade attention reads prefix-cached blocks, so it
# leaves with prefix caching)
ABLATIONS = {"int8 weights + int8 KV": dict(kv_cache_dtype=None, weights="fp32"),
             "speculation (prompt lookup)": dict(draft=None, num_speculative_tokens=None),
             "prefix caching + cascade attention": dict(enable_prefix_caching=False, cascade_attention=False),
             "batch 16 (back to 8)": dict(max_batch_size=8)}


def _serve(name: str, model, tok, workload, reference, delta: float, batch: int, kw: dict) -> Rung:
    """One engine run of the workload as a ladder row."""
    from ..engine import Engine
    from ..quantize import state_dict_bytes
    engine = Engine(model, tok, max_batch_size=batch, max_model_len=workload.max_seq_tokens, **kw)
    engine.generate(["def f(x):"], max_new_tokens=2)                                   # warm up
    memory = state_dict_bytes(model) + engine.cache.nbytes
    return rung(served_by_engine(name, engine, workload), memory, delta, reference, engine_settings(model, batch, kw))


def ablation(model, tok, workload, reference: list[list[int]], int8_delta: float, k: int = 2,
             combined_batch_size: int = 16) -> list[Rung]:
    """The combined rung, then the combined rung without each choice of ABLATIONS, one at a time."""
    from ..quantize import quantize_model
    q_model = quantize_model(model, "int8")
    combined = dict(kv_cache_dtype="int8", enable_prefix_caching=True, cascade_attention=True, draft="ngram",
                    num_speculative_tokens=k)
    rows = [_serve("all combined", q_model, tok, workload, reference, int8_delta, combined_batch_size, combined)]
    for removed, change in ABLATIONS.items():
        kw = {key: value for key, value in {**combined, **change}.items()
              if value is not None and key not in ("weights", "max_batch_size")}
        fp32 = change.get("weights") == "fp32"
        rows.append(_serve(f"without {removed}", model if fp32 else q_model, tok, workload, reference,
                           0.0 if fp32 else int8_delta, change.get("max_batch_size", combined_batch_size), kw))
    return rows


def smaller_model_rung(model, small, tok, workload, reference: list[list[int]], ppl_tokens: int = 1024,
                       max_batch_size: int = 8) -> Rung:
    """A smaller model (same tokenizer) served with continuous batching: its perplexity change is the one
    against the full model on the same validation tokens."""
    from ..quality import perplexity
    seq_len = min(512, ppl_tokens, model.config.max_seq_len, small.config.max_seq_len)
    base = perplexity(model, tok, seq_len=seq_len, max_tokens=ppl_tokens)
    delta = 100 * (perplexity(small, tok, seq_len=seq_len, max_tokens=ppl_tokens) / base - 1)
    row = _serve("a smaller model, continuous batching", small, tok, workload, reference, delta, max_batch_size, {})
    row.settings = f"{small.num_parameters() / 1e6:.1f}M parameters instead of {model.num_parameters() / 1e6:.1f}M; {row.settings}"
    return row
