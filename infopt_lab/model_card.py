"""`infopt-lab card`: measure a bundled model and write its MODEL_CARD.md from the figures."""
from __future__ import annotations

import json

import torch

from .loading import bundled_model_dir, load_model
from .quality import evaluate

# prompts end where a line does: the tokenizer joins a newline with the next line's indent
SAMPLE_PROMPTS = ("def fib(n):", "class LRUCache:", "def read_lines(path, encoding='utf-8'):")


def measure(name: str) -> dict:
    """Parameters, val perplexity and bits per byte, greedy samples and the training log of a model."""
    path = bundled_model_dir(name)
    model, tok = load_model(name, dtype=torch.float32, device="cpu")
    log = [json.loads(line) for line in (path / "train_log.jsonl").read_text().splitlines()]
    recipe = json.loads((path / "recipe.json").read_text())
    samples = [(p, _complete(model, tok, p)) for p in SAMPLE_PROMPTS]
    quality = evaluate(model, tok)
    return {"name": name, "params": model.num_parameters(), "config": model.config,
            "disk_mib": (path / "model.safetensors").stat().st_size / 2**20,
            "ppl": quality.perplexity, "bpb": quality.bits_per_byte,
            "log": log, "recipe": recipe, "samples": samples}


def _complete(model, tok, prompt: str) -> str:
    from .generate import generate
    return generate(model, tok, prompt, max_new_tokens=64).text


def render(m: dict, reference: dict | None = None) -> str:
    """The model card's Markdown."""
    c, r = m["config"], m["recipe"]
    tok_flag = " --tokenizer infopt_lab/assets/models/target" if m["name"] == "draft" else ""
    stages = [(r["init_recipe"], "pretrain"), (r, "distill")] if "init_recipe" in r else [(r, None)]
    lines = [
        f"# infopt-lab `{m['name']}` model", "",
        "A Llama-style decoder trained by the course's own recipe on the Python standard library "
        "source (test suites left out), stored in the Hugging Face Llama format (bf16 safetensors).", "",
        "## Architecture", "",
        "| field | value |", "| --- | --- |",
        f"| parameters | {m['params']:,} ({m['disk_mib']:.1f} MiB on disk) |",
        f"| layers x width | {c.n_layers} x {c.dim} |",
        f"| heads (query / key-value) | {c.n_heads} / {c.n_kv_heads} (head dim {c.head_dim}) |",
        f"| MLP | SwiGLU, {c.intermediate_size} wide |",
        f"| vocabulary | {c.vocab_size} (byte-level BPE, shared by target and draft) |",
        f"| context | {c.max_seq_len} tokens (trained on {r['seq_len']}-token windows) |",
        f"| embeddings | {'tied to the output head' if c.tie_embeddings else 'untied'} |", "",
        "## Training", "",
        *[_stage_line(stage, name, m["log"]) for stage, name in stages], "",
        "Reproduce:", "", "```bash",
        *_reproduce(m["name"], tok_flag, len(stages) > 1),
        "```", "",
        "## Quality on the held-out split", "",
        f"- perplexity: {m['ppl']:.2f} (per token)",
        f"- bits per byte: {m['bpb']:.3f}",
    ]
    if reference is not None:
        lines.append(f"- bits per byte relative to the `{reference['name']}`: "
                     f"{m['bpb'] / reference['bpb']:.2f}x")
    lines += ["", "## Sample completions (greedy, 64 new tokens)", ""]
    for prompt, text in m["samples"]:
        lines += ["```python", prompt + text, "```", ""]
    lines += ["Figures written by `infopt-lab card`; rerun it after retraining."]
    return "\n".join(lines) + "\n"


def _stage_line(r: dict, stage: str | None, log: list[dict]) -> str:
    """One training stage in words: steps, tokens, optimizer, the loss, the time it took."""
    entries = [e for e in log if e.get("stage") == stage] if stage else log
    tokens = r["steps"] * r["batch_size"] * r["seq_len"]
    loss = (f"next-token loss mixed with KL divergence to the `{r['teacher']}` model's distributions "
            f"(weight {r['distill_weight']}), starting from the pretrained weights"
            if r.get("teacher") else "next-token loss")
    label = f"{stage.capitalize()}: " if stage else ""
    return (f"- {label}{r['steps']} steps of {r['batch_size']} x {r['seq_len']} tokens = {tokens / 1e6:.1f}M tokens, "
            f"{loss}; AdamW (peak lr {r['lr']}, cosine, warm-up {r['warmup']}), bf16 autocast, seed {r['seed']}; "
            f"{entries[-1]['elapsed_s'] / 60:.0f} minutes on a 2-core CPU (shared with other work during the run).")


def _reproduce(name: str, tok_flag: str, distilled: bool) -> list[str]:
    if not distilled:
        return [f"infopt-lab train --preset {name} --out infopt_lab/assets/models/{name}{tok_flag}"]
    return [f"infopt-lab train --preset {name} --out runs/{name}-pretrain{tok_flag}",
            f"infopt-lab train --preset {name}-distill --init runs/{name}-pretrain "
            f"--out infopt_lab/assets/models/{name}{tok_flag}"]


def write_cards(names: list[str]) -> list[dict]:
    """Measure the models, print their figures and write each MODEL_CARD.md."""
    measured = {n: measure(n) for n in names}
    target = measured.get("target")
    for name, m in measured.items():
        ref = target if name != "target" else None
        (bundled_model_dir(name) / "MODEL_CARD.md").write_text(render(m, ref))
        print(f"{name:<7}: {m['params']:,} params, val perplexity {m['ppl']:.2f}, "
              f"val bits/byte {m['bpb']:.3f}" +
              (f" ({m['bpb'] / ref['bpb']:.2f}x the target's)" if ref else ""))
    return list(measured.values())
