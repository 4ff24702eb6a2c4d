"""`infopt-lab card`: measure a bundled model and write its MODEL_CARD.md from the figures."""
from __future__ import annotations

import json

import torch

from .loading import bundled_model_dir, load_model, reproduce_commands
from .quality import evaluate

# prompts end where a line does: the tokenizer joins a newline with the next line's indent
SAMPLE_PROMPTS = ("def fib(n):", "class LRUCache:", "def read_lines(path, encoding='utf-8'):")
REFERENCE_OF = {"draft": "target", "smollm2-135m-draft": "smollm2-135m"}   # the model each one is compared with
# SmolLM2's pair is scored on the first 32k tokens of the split: the whole of it takes minutes per model on a CPU
QUALITY_TOKENS = {"smollm2-135m-draft": 32768, "smollm2-135m": 32768}


def measure(name: str) -> dict:
    """Parameters, val perplexity and bits per byte, greedy samples and the training log of a model."""
    path = bundled_model_dir(name)
    model, tok = load_model(name, dtype=torch.float32, device="cpu")
    log = [json.loads(line) for line in (path / "train_log.jsonl").read_text().splitlines()]
    recipe = json.loads((path / "recipe.json").read_text())
    samples = [(p, _complete(model, tok, p)) for p in SAMPLE_PROMPTS]
    quality = evaluate(model, tok, max_tokens=QUALITY_TOKENS.get(name))
    return {"name": name, "params": model.num_parameters(), "config": model.config, "model": model, "tok": tok,
            "disk_mib": (path / "model.safetensors").stat().st_size / 2**20,
            "ppl": quality.perplexity, "bpb": quality.bits_per_byte, "scored_tokens": quality.n_tokens if name in QUALITY_TOKENS else None,
            "log": log, "recipe": recipe, "samples": samples}


def measure_reference(name: str, draft: dict) -> dict:
    """The reference model's quality on the draft's tokens, and the draft's greedy acceptance against it (k = 4)."""
    from .distill import draft_acceptance, validation_prompts
    model, tok = load_model(name, dtype=torch.float32, device="cpu")
    quality = evaluate(model, tok, max_tokens=QUALITY_TOKENS.get(name))
    alpha = draft_acceptance(model, draft["model"], tok, validation_prompts(8), k=4, new_tokens=48)
    return {"name": name, "params": model.num_parameters(), "ppl": quality.perplexity, "bpb": quality.bits_per_byte,
            "alpha": alpha}


def _complete(model, tok, prompt: str) -> str:
    from .generate import generate
    return generate(model, tok, prompt, max_new_tokens=64).text


def render(m: dict, reference: dict | None = None) -> str:
    """The model card's Markdown."""
    c, r = m["config"], m["recipe"]
    stages = [(r["init_recipe"], "pretrain"), (r, "distill")] if "init_recipe" in r else [(r, None)]
    smol = m["name"] == "smollm2-135m-draft"
    about = ("SmolLM2-135M-Instruct's speculative draft: a Llama-style decoder with SmolLM2's tokenizer, trained by "
             "the course's own recipe on the Python standard library source (test suites left out) in SmolLM2's "
             "tokenization, then distilled from SmolLM2-135M through a cache of its top-k logits"
             if smol else "A Llama-style decoder trained by the course's own recipe on the Python standard library "
             "source (test suites left out)")
    vocab = ("SmolLM2's byte-level BPE, shared with `smollm2-135m`" if smol
             else "byte-level BPE, shared by target and draft")
    lines = [
        f"# infopt-lab `{m['name']}` model", "",
        about + ", stored in the Hugging Face Llama format (bf16 safetensors).", "",
        "## Architecture", "",
        "| field | value |", "| --- | --- |",
        f"| parameters | {m['params']:,} ({m['disk_mib']:.1f} MiB on disk) |",
        f"| layers x width | {c.n_layers} x {c.dim} |",
        f"| heads (query / key-value) | {c.n_heads} / {c.n_kv_heads} (head dim {c.head_dim}) |",
        f"| MLP | SwiGLU, {c.intermediate_size} wide |",
        f"| vocabulary | {c.vocab_size} ({vocab}) |",
        f"| context | {c.max_seq_len} tokens (trained on {r['seq_len']}-token windows) |",
        f"| embeddings | {'tied to the output head' if c.tie_embeddings else 'untied'} |", "",
        "## Training", "",
        *[_stage_line(stage, name, m["log"]) for stage, name in stages], "",
        "Reproduce:", "", "```bash",
        *reproduce_commands(m["name"]),
        "```", "",
        "## Quality on the held-out split", "",
        f"- perplexity: {m['ppl']:.2f} (per token)",
        f"- bits per byte: {m['bpb']:.3f}",
    ]
    if m.get("scored_tokens"):
        lines[-2] += f" (the first {m['scored_tokens']:,} tokens of the split)"
    if reference is not None:
        lines.append(f"- bits per byte relative to `{reference['name']}` (perplexity {reference['ppl']:.2f}, "
                     f"{reference['bpb']:.3f} bits per byte on the same text): {m['bpb'] / reference['bpb']:.2f}x")
        lines.append(f"- parameters relative to `{reference['name']}`: {m['params'] / reference['params']:.3f}x")
        if "alpha" in reference:
            lines.append(f"- as `{reference['name']}`'s speculative draft: greedy acceptance "
                         f"{reference['alpha']:.1%} (k = 4, the first function of 8 held-out files, 48 new tokens each)")
    lines += ["", "## Sample completions (greedy, 64 new tokens)", ""]
    for prompt, text in m["samples"]:
        lines += ["```python", prompt + text, "```", ""]
    lines += ["Figures written by `infopt-lab card`; rerun it after retraining."]
    return "\n".join(lines) + "\n"


def _stage_line(r: dict, stage: str | None, log: list[dict]) -> str:
    """One training stage in words: steps, tokens, optimizer, the loss, the time it took."""
    entries = [e for e in log if e.get("stage") == stage] if stage else log
    tokens = r["steps"] * r["batch_size"] * r["seq_len"]
    cached = (f" (its top {r['teacher_topk']} logits, cached once on {r['teacher_windows']} training windows)"
              if r.get("teacher_topk") else "")
    loss = (f"next-token loss mixed with KL divergence to the `{r['teacher']}` model's distributions{cached} "
            f"(weight {r['distill_weight']}), starting from the pretrained weights"
            if r.get("teacher") else "next-token loss")
    label = f"{stage.capitalize()}: " if stage else ""
    return (f"- {label}{r['steps']} steps of {r['batch_size']} x {r['seq_len']} tokens = {tokens / 1e6:.1f}M tokens, "
            f"{loss}; AdamW (peak lr {r['lr']}, cosine, warm-up {r['warmup']}), bf16 autocast, seed {r['seed']}; "
            f"{entries[-1]['elapsed_s'] / 60:.0f} minutes on a 2-core CPU (shared with other work during the run).")


def write_cards(names: list[str]) -> list[dict]:
    """Measure the models, print their figures and write each MODEL_CARD.md."""
    measured = {n: measure(n) for n in names}
    for name, m in measured.items():
        ref = None
        if name in REFERENCE_OF:
            ref = measure_reference(REFERENCE_OF[name], m)
        (bundled_model_dir(name) / "MODEL_CARD.md").write_text(render(m, ref))
        print(f"{name}: {m['params']:,} params, val perplexity {m['ppl']:.2f}, val bits/byte {m['bpb']:.3f}" +
              (f" ({m['bpb'] / ref['bpb']:.2f}x {ref['name']}'s; greedy acceptance as its draft "
               f"{ref['alpha']:.1%})" if ref else ""))
    return list(measured.values())
