"""Train the bundled feature draft `smollm2-135m-eagle` (feature_draft.py): data, features, frequent tokens, training.

Stages, each cached under --work so an interrupted run resumes where it stopped:
1. prompts from the corpus's training split (code to continue, chat questions about functions) answered
   greedily by SmolLM2-135M in the engine, one set per prompt seed (completions-SEED.json);
2. the target's last hidden states over prompt + answer and over windows of training-split code (features/);
3. the covered vocabulary: the target's most frequent choices over those features;
4. the draft's fc and layer trained on feature regression plus cross-entropy (train_log.jsonl), then saved.

    python scripts/train_feature_draft.py --out infopt_lab/assets/models/smollm2-135m-eagle

The defaults are the bundled draft's recipe (its MODEL_CARD.md gives the full command).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import infopt_lab as lab
from infopt_lab import feature_draft as fd
from infopt_lab import feature_train as ft
from infopt_lab.data import read_texts
from infopt_lab.device import cpu_name
from infopt_lab.loading import load_model


def corpus_windows(tok, n: int, window: int, seed: int) -> list[list[int]]:
    """n windows of training-split code, `window` tokens each, from random files."""
    rng = np.random.default_rng(seed)
    texts = [t for t in read_texts("train") if len(t) > 8 * window]
    out = []
    while len(out) < n:
        text = texts[rng.integers(len(texts))]
        start = int(rng.integers(0, len(text) - 6 * window))
        ids = tok.encode(text[start:start + 6 * window])[1:window + 1]
        if len(ids) == window:
            out.append(ids)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command's options; their defaults are the bundled draft's recipe (a test holds them to its card)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="runs/eagle")
    ap.add_argument("--code-prompts", type=int, default=320)
    ap.add_argument("--chat-prompts", type=int, default=480)
    ap.add_argument("--prompt-seeds", type=int, nargs="+", default=[29, 30],
                    help="each seed draws --code-prompts + --chat-prompts more prompts (repeats dropped)")
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--corpus-windows", type=int, default=1200)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.006)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--cls-weight", type=float, default=1.0)
    ap.add_argument("--reg-weight", type=float, default=1.0)
    ap.add_argument("--reg-space", choices=("normed", "raw"), default="normed",
                    help="regress the features after the target's final norm (what its head reads) or before it")
    ap.add_argument("--max-minutes", type=float, default=75)
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--card-only", action="store_true", help="measure the saved draft and write its MODEL_CARD.md")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.card_only:
        write_card(Path(args.out))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    target, tok = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
    started = time.time()

    sequences, seen = [], set()
    for seed in args.prompt_seeds:                       # one answer file per seed: more seeds, more data
        done = work / f"completions-{seed}.json"
        if not done.exists():
            prompts = [p for p in ft.training_prompts(tok, args.code_prompts, args.chat_prompts, seed=seed)
                       if p not in seen]
            engine = lab.Engine(target, tok, max_batch_size=32, max_model_len=1024)
            t0 = time.time()
            outs = engine.generate(prompts, max_new_tokens=args.new_tokens, temperature=0.0, progress=True)
            print(f"seed {seed}: generated {sum(len(o.token_ids) for o in outs)} tokens for {len(outs)} prompts "
                  f"in {time.time() - t0:.0f} s", flush=True)
            done.write_text(json.dumps({"prompts": prompts, "sequences": [o.prompt_ids + o.token_ids
                                                                           for o in outs if o.ok]}))
        cached = json.loads(done.read_text())
        seen.update(cached["prompts"])
        sequences += cached["sequences"]
    answered = len(sequences)
    sequences += corpus_windows(tok, args.corpus_windows, args.window, args.seed)
    data = ft.build_features(target, sequences, work / "features", window=args.window)
    print(f"features: {len(data)} windows, {int(data.lengths.sum())} tokens", flush=True)

    val_n = max(8, len(data) // 20)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    data = ft.FeatureData(data.tokens[order], data.features[order], data.lengths[order])
    train, val = data.split(val_n)
    choices = ft.target_choices(target, train)
    eos = [target.config.eos_token_id]
    token_ids = ft.frequent_tokens(choices, args.vocab, always=eos)
    val_choices = ft.target_choices(target, val)
    cover = {n: ft.coverage(val_choices, ft.frequent_tokens(choices, n, always=eos))
             for n in (1024, 2048, 4096, 8192, 16384)}
    print("held-out coverage by covered-vocabulary size:", json.dumps(cover), flush=True)

    draft = fd.initial_draft(target, token_ids, seed=args.seed)
    log = work / "train_log.jsonl"
    log.unlink(missing_ok=True)
    history = ft.train_draft(draft, train, args.steps, batch_size=args.batch_size, lr=args.lr, unroll=args.unroll,
                             seed=args.seed, val=val, log=log, max_minutes=args.max_minutes,
                             cls_weight=args.cls_weight, reg_weight=args.reg_weight,
                             normed=args.reg_space == "normed")
    card = {"vocab": args.vocab, "held_out_coverage": cover[args.vocab] if args.vocab in cover else
            ft.coverage(val_choices, token_ids), "coverage_by_size": cover,
            "answered_prompts": answered, "train_windows": len(train), "train_tokens": int(train.lengths.sum()),
            "steps": history[-1]["step"] + 1, "batch_size": args.batch_size, "lr": args.lr, "unroll": args.unroll,
            "cls_weight": args.cls_weight, "reg_weight": args.reg_weight, "reg_space": args.reg_space,
            "cpu": cpu_name(),
            "final": history[-1], "minutes": round((time.time() - started) / 60, 1),
            "command": "python scripts/train_feature_draft.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items() if k != "card_only")}
    draft.save_pretrained(args.out, card=card)
    (Path(args.out) / "train_log.jsonl").write_text(log.read_text())
    print(json.dumps(card, indent=2), flush=True)
    write_card(Path(args.out))


def write_card(out: Path, n_prompts: int = 16, k: int = 3, new_tokens: int = 48) -> None:
    """MODEL_CARD.md: what the draft is, its data and training, and its acceptance beside the distilled draft's."""
    from infopt_lab.bench.exactness import heldout_prompts
    from infopt_lab.generate import encode_prompt
    from infopt_lab.speculative import SpeculativeOutput, speculative_generate
    target, tok = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
    draft = fd.FeatureDraft.from_pretrained(out, target)
    distilled, _ = load_model("smollm2-135m-draft", dtype=torch.float32, device="cpu")
    meta = json.loads((out / "config.json").read_text())
    prompts = heldout_prompts(tok, n_prompts, seed=26)
    found = {}
    for name, d in (("feature draft", draft), ("smollm2-135m-draft", distilled)):
        outs = [speculative_generate(target, d, encode_prompt(target, tok, p), k=k, max_new_tokens=new_tokens)
                for p in prompts]
        found[name] = SpeculativeOutput([], k, [r for o in outs for r in o.rounds], 0, 0, 1.0)
    size = (out / "draft.safetensors").stat().st_size
    cover = meta["coverage_by_size"]
    space = ("after SmolLM2's final norm (what its head reads)" if meta.get("reg_space") == "normed"
             else "before the final norm")
    lines = [
        f"# infopt-lab `{fd.BUNDLED_NAME}` feature draft", "",
        "SmolLM2-135M-Instruct's feature-level speculative draft (EAGLE's idea, Li et al. 2024): one decoder "
        "layer that reads SmolLM2's last hidden state and the next token's embedding and predicts SmolLM2's next "
        "hidden state; SmolLM2's own final norm and head, restricted to the tokens it says most often, turn the "
        "guess into a token. Only the draft's own weights are stored (`draft.safetensors`, bf16): the merging "
        "linear layer, the decoder layer and the covered token ids; the embedding, norm and head are read from "
        "the target at load time (`lab.load_feature_draft(target)`).", "",
        "## Architecture", "",
        "| field | value |", "| --- | --- |",
        f"| parameters of its own | {draft.num_parameters():,} ({size / 2**20:.1f} MiB on disk) |",
        f"| layers | 1 (SmolLM2's layer shape: width {draft.config.dim}, {draft.config.n_heads} query / "
        f"{draft.config.n_kv_heads} key-value heads, MLP {draft.config.intermediate_size}) |",
        f"| covered vocabulary | {draft.coverage_size:,} of {draft.config.vocab_size:,} tokens, by SmolLM2's "
        f"frequency of choice; {meta['held_out_coverage']:.1%} of SmolLM2's choices on held-out windows |",
        "| coverage by size | " + ", ".join(f"{n}: {float(c):.1%}" for n, c in cover.items()) + " |", "",
        "## Data and training", "",
        "- Prompts from the corpus's training split: code to continue, and chat questions about documented "
        "functions; SmolLM2 answered "
        + (f"{meta['answered_prompts']:,} of them" if "answered_prompts" in meta else "them")
        + " greedily in the engine (up to 160 new tokens), plus windows of training-split code.",
        f"- SmolLM2's last hidden states over {meta['train_windows']:,} windows ({meta['train_tokens']:,} tokens) "
        "cached once (fp32 model, bf16 features); the covered tokens are SmolLM2's most frequent greedy choices there.",
        f"- {meta['steps']} steps of {meta['batch_size']} windows, AdamW (lr {meta['lr']}, cosine), loss = "
        f"{meta.get('reg_weight', 1.0)} x smooth L1 on the features "
        f"{space} + {meta.get('cls_weight', 0.1)} x cross-entropy to SmolLM2's distribution over the "
        "covered tokens, "
        f"unrolled {meta['unroll']} steps (each later step reads the draft's own guess); the layer starts as a "
        f"copy of SmolLM2's last layer. Training took {meta['final']['elapsed_s'] / 60:.0f} minutes on a 2-core "
        f"CPU ({meta.get('cpu', 'not recorded')}); before it, once, SmolLM2 answers the prompts and its features "
        "are cached under `--work` (the command resumes from what it finds there).",
        "- Final held-out top-1 agreement with SmolLM2: " + ", ".join(
            f"step {i} {meta['final'][f'val_top1_{i}']:.1%}" for i in range(1, meta["unroll"] + 1)
            if f"val_top1_{i}" in meta["final"]) + ".", "",
        "Reproduce:", "", "```bash", meta["command"], "```", "",
        f"## As SmolLM2's draft (greedy, k = {k}, {n_prompts} held-out prompts, {new_tokens} new tokens)", "",
        "| draft | accepted / proposed | alpha | acceptance by position |", "| --- | --- | --- | --- |"]
    for name, run in found.items():
        lines.append(f"| {name} | {run.draft_yield:.2f} | {run.acceptance_rate:.2f} | "
                     + ", ".join(f"{a:.2f}" for a in run.acceptance_by_position) + " |")
    lines += ["", "`infopt-lab bench --only feature_draft` measures these beside the speedups they give.", ""]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
