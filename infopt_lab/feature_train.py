"""Training a feature draft (feature_draft.py): the target's features over text, the covered vocabulary, the loss.

The target runs once over its training text (`build_features`: windows of its tokens and its last
hidden states, cached in resumable chunks); the covered vocabulary is what the target chooses most
often there (`frequent_tokens`, `coverage`); the draft then learns to guess the next feature and the
target's next-token distribution (`draft_loss`, `train_draft`), unrolled as it is used.
`scripts/train_feature_draft.py` makes the bundled `smollm2-135m-eagle` this way; notebook 06 trains
a small one in a minute.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from . import validate
from .feature_draft import FeatureDraft

# -- training data: the target's features over text it reads and text it writes ----------------
QUESTIONS = (
    "What does this Python function do? Answer in one short sentence.\n\n{code}",
    "Explain what this Python code does, step by step.\n\n{code}",
    "Write a Python function for this description: {summary}",
    "Write a short docstring for this function.\n\n{code}",
    "Is there a bug in this function? Answer briefly.\n\n{code}",
)


def _train_functions(limit: int, seed: int) -> list[tuple[str, str]]:
    """(source, docstring summary) of documented functions in the training split of the corpus, shuffled."""
    import ast
    from .data import read_texts
    found, texts = [], read_texts("train")
    random.Random(seed).shuffle(texts)
    for text in texts:
        if len(found) >= 4 * limit:              # enough to choose from: parsing every file takes minutes
            break
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
                src = ast.get_source_segment(text, node) or ""
                if 80 < len(src) < 1200:
                    summary = " ".join(ast.get_docstring(node).split("\n\n")[0].split())
                    found.append((src, summary))
    random.Random(seed).shuffle(found)
    return found[:limit]


def training_prompts(tok, n_code: int, n_chat: int, seed: int = 29) -> list[str]:
    """Prompts from the corpus's training split for the target to answer: code to continue and chat questions."""
    from .workloads import code_prompts
    prompts = code_prompts(tok, n_code, min_tokens=16, max_tokens=96, seed=seed, split="train")
    rng = random.Random(seed)
    for src, summary in _train_functions(n_chat, seed):
        question = rng.choice(QUESTIONS).format(code=src.strip(), summary=summary)
        prompts.append(tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True))
    return prompts


@dataclass
class FeatureData:
    """Fixed windows of the target's tokens [N, T], its features [N, T, C] (bf16) and each window's length [N]."""

    tokens: Tensor
    features: Tensor
    lengths: Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def split(self, val: int) -> tuple["FeatureData", "FeatureData"]:
        """The last `val` windows held out, the rest for training."""
        a = FeatureData(self.tokens[:-val], self.features[:-val], self.lengths[:-val])
        return a, FeatureData(self.tokens[-val:], self.features[-val:], self.lengths[-val:])


def _windows(sequences: list[list[int]], window: int) -> list[list[int]]:
    """Each sequence cut into windows of at most `window` tokens (a short tail kept when it has 16 or more)."""
    out = []
    for s in sequences:
        for i in range(0, len(s), window):
            if len(s[i:i + window]) >= 16:
                out.append(s[i:i + window])
    return out


@torch.no_grad()
@torch.no_grad()
def build_features(target, sequences: list[list[int]], path: str | Path | None, window: int = 256, chunk: int = 32,
                   progress: bool = True) -> FeatureData:
    """The target's last hidden states over every sequence, in windows; cached in chunks under `path` (resumable).

    A folder holding features of other windows is refused, not mixed in. `path=None` keeps them in memory only.
    """
    from safetensors.torch import load_file, save_file
    window = validate.integer("window", window, low=16, high=target.config.max_seq_len)
    windows = _windows(sequences, window)
    if not windows:
        raise ValueError("no sequence holds 16 tokens or more: nothing to learn from")
    if path is not None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"windows": len(windows), "window": window, "chunk": chunk,
                "tokens_sum": sum(sum(w) for w in windows), "width": target.config.dim,
                "layers": target.config.n_layers}
        meta_file = path / "meta.json"
        if meta_file.exists() and json.loads(meta_file.read_text()) != meta:
            raise ValueError(f"{path} holds features of other windows ({meta_file}); remove it or choose another folder")
        meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    device = next(target.parameters()).device
    parts = []
    for start in tqdm(range(0, len(windows), chunk), disable=not progress, desc="target features"):
        file = None if path is None else path / f"features-{start // chunk:05d}.safetensors"
        if file is not None and file.exists():
            parts.append(load_file(str(file)))
            continue
        group = windows[start:start + chunk]
        tokens = torch.zeros(len(group), window, dtype=torch.int32)
        feats = torch.zeros(len(group), window, target.config.dim, dtype=torch.bfloat16)
        for i, w in enumerate(group):
            tokens[i, :len(w)] = torch.tensor(w)
            feats[i, :len(w)] = target.hidden_states(torch.tensor([w], device=device))[0].to(torch.bfloat16).cpu()
        part = {"tokens": tokens, "features": feats, "lengths": torch.tensor([len(w) for w in group])}
        if file is not None:
            tmp = file.with_name(file.name + ".tmp")
            save_file(part, str(tmp))
            tmp.rename(file)
        parts.append(part)
    return FeatureData(*(torch.cat([p[k] for p in parts]) for k in ("tokens", "features", "lengths")))


@torch.no_grad()
def target_choices(target, data: FeatureData, batch: int = 16) -> Tensor:
    """The target's greedy next token at every valid position of the data [N, T] (-1 past each window's end)."""
    out = torch.full(data.tokens.shape, -1, dtype=torch.long)
    for i in range(0, len(data), batch):
        h = data.features[i:i + batch].float()
        out[i:i + batch] = target.logits(h).argmax(-1)
    mask = torch.arange(data.tokens.shape[1])[None] >= data.lengths[:, None]
    return out.masked_fill(mask, -1)


def frequent_tokens(choices: Tensor, size: int, always: list[int] = ()) -> Tensor:
    """The `size` tokens the target chose most often (ties by id), the `always` ids first."""
    ids = choices[choices >= 0]
    counts = torch.bincount(ids, minlength=int(ids.max()) + 1)
    order = [t for t in always]
    for t in torch.argsort(counts, descending=True, stable=True).tolist():
        if len(order) >= size:
            break
        if t not in order:
            order.append(t)
    return torch.tensor(order[:size])


def coverage(choices: Tensor, token_ids: Tensor) -> float:
    """Share of the target's choices that are among `token_ids`."""
    ids = choices[choices >= 0]
    covered = torch.zeros(int(max(ids.max(), token_ids.max())) + 1, dtype=torch.bool)
    covered[token_ids] = True
    return float(covered[ids].float().mean())


# -- training ----------------------------------------------------------------------------------
def draft_loss(draft: FeatureDraft, feats: Tensor, tokens: Tensor, lengths: Tensor, unroll: int = 2,
               cls_weight: float = 0.1, reg_weight: float = 1.0, normed: bool = True) -> tuple[Tensor, dict]:
    """Feature regression (smooth L1) plus cross-entropy to the target's distribution over the covered tokens.

    feats [B, T, C] (fp32), tokens [B, T]. Row j reads (h_j, x_{j+1}) and must give h_{j+1}. With unroll = 2
    the same windows run again with the first pass's guesses in place of the features (shifted by one), as
    the draft's second proposal reads its own guess: training as it is used (EAGLE-3's training-time test).
    `normed=True` compares the features after the target's final norm, the space its head reads: a
    pre-norm last hidden state carries a few channels far larger than the rest (SmolLM2's does), which
    would otherwise dominate the regression.
    """
    B, T, C = feats.shape
    h_in, x_in, h_out = feats[:, :-1], tokens[:, 1:], feats[:, 1:]
    valid = (torch.arange(T - 1, device=feats.device)[None] < (lengths[:, None] - 1)).float()   # (B, T-1)
    with torch.no_grad():
        p = draft.covered_logits(h_out).float().softmax(-1)                  # the target's view, covered tokens
        want = p.argmax(-1)
    pos = torch.arange(T - 1, device=feats.device)
    total, stats, guess = 0.0, {}, h_in
    for step in range(unroll):
        if step:
            guess = torch.cat([h_in[:, :1], guess[:, :-1]], dim=1)             # row j reads the guess of h_j
        guess = draft.hidden(guess if step else h_in, x_in, pos)
        a, b = (draft.target.norm(guess), draft.target.norm(h_out)) if normed else (guess, h_out)
        reg = (F.smooth_l1_loss(a, b, reduction="none").mean(-1) * valid).sum() / valid.sum()
        logp = draft.covered_logits(guess).float().log_softmax(-1)
        cls = (-(p * logp).sum(-1) * valid).sum() / valid.sum()
        total = total + reg_weight * reg + cls_weight * cls
        stats[f"top1_{step + 1}"] = float(((logp.argmax(-1) == want).float() * valid).sum() / valid.sum())
        stats[f"reg_{step + 1}"], stats[f"cls_{step + 1}"] = reg.item(), cls.item()
    return total / unroll, stats


def train_draft(draft: FeatureDraft, data: FeatureData, steps: int, batch_size: int = 8, lr: float = 1e-3,
                warmup: int = 50, unroll: int = 2, seed: int = 0, val: FeatureData | None = None,
                log: str | Path | None = None, eval_every: int = 100, max_minutes: float | None = None,
                cls_weight: float = 0.1, reg_weight: float = 1.0, normed: bool = True,
                progress: bool = True) -> list[dict]:
    """Train the draft's fc and layer (AdamW, cosine after warm-up); the history of logged steps.

    The loss is `draft_loss`'s: `reg_weight` x feature regression (after the target's norm where `normed`)
    plus `cls_weight` x cross-entropy to the target. `max_minutes` ends the run early (after a logged step);
    `val` adds held-out figures to each log row.
    """
    steps = validate.integer("steps", steps, low=1)
    params = list(draft.fc.parameters()) + list(draft.block.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(seed)
    history, start = [], time.perf_counter()
    bar = tqdm(range(steps), disable=not progress, desc="feature draft")
    draft.train()
    for step in bar:
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * max(scale, 0.02)
        idx = torch.from_numpy(rng.integers(0, len(data), size=batch_size))
        loss, stats = draft_loss(draft, data.features[idx].float(), data.tokens[idx].long(), data.lengths[idx],
                                 unroll, cls_weight, reg_weight, normed)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{stats['top1_1']:.2f}")
        elapsed = time.perf_counter() - start
        last = step == steps - 1 or (max_minutes is not None and elapsed > 60 * max_minutes)
        if step % eval_every == 0 or last:
            row = {"step": step, "loss": loss.item(), **stats, "elapsed_s": round(elapsed, 1)}
            if val is not None:
                held = evaluate_draft(draft, val, unroll, cls_weight, reg_weight, normed)
                row |= {f"val_{k}": v for k, v in held.items()}
            history.append(row)
            if log is not None:
                with open(log, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if last:
            break
    draft.eval()
    return history


@torch.no_grad()
def evaluate_draft(draft: FeatureDraft, data: FeatureData, unroll: int = 2, cls_weight: float = 0.1,
                   reg_weight: float = 1.0, normed: bool = True, batch: int = 16) -> dict:
    """Mean loss terms and top-1 agreement with the target over held-out windows."""
    was = draft.training
    draft.eval()
    sums, n = {}, 0
    for i in range(0, len(data), batch):
        loss, stats = draft_loss(draft, data.features[i:i + batch].float(), data.tokens[i:i + batch].long(),
                                 data.lengths[i:i + batch], unroll, cls_weight, reg_weight, normed)
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v * len(data.tokens[i:i + batch])
        n += len(data.tokens[i:i + batch])
    draft.train(was)
    return {k: v / n for k, v in sums.items()}
