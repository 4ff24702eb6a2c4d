"""Knowledge distillation: a small student learns to imitate a teacher's next-token distributions.

The loss mixes two terms. The hard-label term is the ordinary next-token cross-entropy
against the text. The distillation term is the forward KL divergence from the teacher's
distribution to the student's, both softened by a temperature T, and scaled by T**2 so
its gradients keep their size as T changes (Hinton et al., 2015).

Running a 135M-parameter teacher on every step would cost more than training a 13M
student. So the teacher runs once per training window, and its top-k logits at each
position are kept on disk (`TeacherCache`, safetensors in chunks: an interrupted run
resumes at the next missing chunk). Later epochs read the cache. Over the top k the
teacher's distribution is renormalised, and the mass outside them is dropped (notebook 06
measures how much).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from . import validate
from .device import bf16_autocast


def distillation_loss(student_logits: Tensor, targets: Tensor, teacher_logits: Tensor,
                      teacher_indices: Tensor | None = None, weight: float = 0.9,
                      temperature: float = 1.0) -> Tensor:
    """(1 - weight) * cross-entropy(targets) + weight * T**2 * KL(teacher_T || student_T), mean per position.

    student_logits: [N, V]; targets: [N] token ids; teacher_logits: [N, V], or [N, k] with
    teacher_indices [N, k] naming the vocabulary entries they belong to (a top-k cache).
    """
    weight = validate.real("weight", weight, low=0, high=1)
    temperature = validate.real("temperature", temperature, low=0, low_open=True)
    logp = student_logits.float().log_softmax(-1)                         # (N, V)
    hard = F.nll_loss(logp, targets)
    if weight == 0:
        return hard
    s_logp = logp if temperature == 1 else (student_logits.float() / temperature).log_softmax(-1)
    if teacher_indices is not None:
        s_logp = s_logp.gather(-1, teacher_indices.long())                # (N, k)
    t_logp = (teacher_logits.float() / temperature).log_softmax(-1)       # (N, V) or (N, k), renormalised
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
    return (1 - weight) * hard + weight * temperature ** 2 * kl


class TeacherCache:
    """A teacher's top-k logits at every position of fixed training windows, computed once.

    `windows` is [N, T + 1] token ids (inputs are [:, :-1], targets [:, 1:]); `values` [N, T, k]
    (fp16) and `indices` [N, T, k] (int32) hold the teacher's k largest logits per position.
    """

    def __init__(self, windows: Tensor, values: Tensor, indices: Tensor):
        if values.shape != indices.shape or values.shape[:2] != (windows.shape[0], windows.shape[1] - 1):
            raise ValueError(f"cache shapes disagree: windows {tuple(windows.shape)}, values "
                             f"{tuple(values.shape)}, indices {tuple(indices.shape)}")
        self.windows, self.values, self.indices = windows, values, indices

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def k(self) -> int:
        return self.values.shape[-1]

    def batch(self, rng: np.random.Generator, batch_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Random cached windows: inputs [B, T], targets [B, T], teacher values and indices [B, T, k]."""
        idx = torch.from_numpy(rng.integers(0, len(self), size=batch_size))
        w = self.windows[idx].long()
        return w[:, :-1], w[:, 1:], self.values[idx], self.indices[idx]

    @classmethod
    @torch.no_grad()
    def build(cls, teacher, windows: Tensor, path: str | Path | None = None, k: int = 32, batch_size: int = 4,
              fingerprint: dict | None = None, progress: bool = True) -> "TeacherCache":
        """Run `teacher` over `windows` once (bf16 where the device has it) and keep its top-k logits (under `path` if given).

        Chunks already on disk are reused, so an interrupted build resumes; a cache built from
        other windows, another k or another teacher (`fingerprint`) is refused, not mixed in.
        """
        k = validate.integer("k", k, low=1, high=teacher.config.vocab_size)
        batch_size = validate.integer("batch_size", batch_size, low=1)
        from safetensors.torch import load_file, save_file
        windows = windows.to(torch.int32)
        if path is not None:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            meta = {"k": k, "batch_size": batch_size, "shape": list(windows.shape),
                    "windows_sum": int(windows.long().sum()), "teacher": fingerprint or {}}
            meta_file = path / "meta.json"
            if meta_file.exists() and json.loads(meta_file.read_text()) != meta:
                raise ValueError(f"{path} holds a teacher cache built differently ({meta_file}); "
                                 "remove the folder or choose another output directory")
            meta_file.write_text(json.dumps(meta, indent=2) + "\n")
        device = next(teacher.parameters()).device
        values, indices = [], []
        for i in tqdm(range(0, len(windows), batch_size), disable=not progress, desc="teacher top-k"):
            chunk = None if path is None else path / f"topk-{i // batch_size:05d}.safetensors"
            if chunk is not None and chunk.exists():
                part = load_file(str(chunk))
            else:
                x = windows[i:i + batch_size, :-1].long().to(device)
                with bf16_autocast(device):
                    top = teacher(x).float().topk(k, dim=-1)                 # (b, T, k) each
                part = {"values": top.values.half().cpu().contiguous(), "indices": top.indices.int().cpu().contiguous()}
                if chunk is not None:
                    tmp = chunk.with_name(chunk.name + ".tmp")
                    save_file(part, str(tmp))
                    tmp.rename(chunk)
            values.append(part["values"])
            indices.append(part["indices"])
        return cls(windows, torch.cat(values), torch.cat(indices))


def agreement(student, teacher, windows: Tensor, batch_size: int = 8) -> float:
    """Share of positions of `windows` ([N, T + 1]) where the student's top token is the teacher's."""
    hits, total = 0, 0
    with torch.inference_mode():
        for i in range(0, len(windows), batch_size):
            x = windows[i:i + batch_size, :-1]                                    # (B, T), on the CPU
            top_s, top_t = (m(x.to(next(m.parameters()).device)).argmax(-1).cpu() for m in (student, teacher))
            same = top_s == top_t                                                 # (B, T)
            hits, total = hits + int(same.sum()), total + same.numel()
    return hits / total


def distill(student, teacher, tok, steps: int = 200, weight: float = 0.9, temperature: float = 1.0,
            cache: TeacherCache | None = None, windows: int = 128, k: int = 32, batch_size: int = 8,
            seq_len: int = 256, lr: float = 3e-3, warmup: int = 20, eval_every: int = 50, seed: int = 0,
            progress: bool = True) -> list[dict]:
    """Train `student` in place to imitate `teacher`; returns the log (step, loss, val bits per byte, agreement).

    weight=0 trains on hard labels alone, on the same cached windows in the same order, so two
    students that differ only in `weight` differ only in their loss. Pass one `cache` to both
    to build the teacher's top-k once.
    """
    from . import data
    from .quality import split_tokens
    from .recipe import Recipe, lr_at, optimizer, update, val_bits_per_byte
    steps = validate.integer("steps", steps, low=1)
    weight = validate.real("weight", weight, low=0, high=1)
    temperature = validate.real("temperature", temperature, low=0, low_open=True)
    if student.config.vocab_size != teacher.config.vocab_size:
        raise ValueError(f"the student's vocabulary ({student.config.vocab_size}) differs from the teacher's "
                         f"({teacher.config.vocab_size}): distillation needs one shared tokenizer")
    if cache is None:
        cache = teacher_cache(teacher, tok, windows=windows, seq_len=seq_len, k=k, seed=seed, progress=progress)
    recipe = Recipe(preset="distill", steps=steps, batch_size=batch_size, seq_len=cache.windows.shape[1] - 1,
                    lr=lr, warmup=min(warmup, steps), distill_weight=weight, temperature=temperature,
                    teacher="given" if weight else None)
    val_tokens, byte_lengths = split_tokens(tok, "val")
    val = data.eval_windows(val_tokens, recipe.seq_len, 16)
    opt = optimizer(student, recipe)
    student.train()
    log = []
    bar = tqdm(range(steps), disable=not progress, desc=f"distill (weight {weight})")
    device = next(student.parameters()).device
    for step in bar:
        x, y, values, indices = (t.to(device) for t in cache.batch(np.random.default_rng([seed, step]), batch_size))
        with bf16_autocast(device):
            logits = student(x)                                           # (B, T, V)
        loss = distillation_loss(logits.flatten(0, 1), y.flatten(), values.flatten(0, 1),
                                 indices.flatten(0, 1), weight, temperature)
        update(student, opt, loss, lr_at(step, recipe), recipe)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            log.append({"step": step + 1, "loss": round(loss.item(), 4),
                        "val_bpb": round(val_bits_per_byte(student, val, byte_lengths), 4),
                        "agreement": round(agreement(student.eval(), teacher, val), 4)})
            student.train()
    return log


def teacher_cache(teacher, tok, windows: int = 128, seq_len: int = 256, k: int = 32, seed: int = 0,
                  path: str | Path | None = None, progress: bool = True) -> TeacherCache:
    """The teacher's top-k logits on `windows` random training windows of the corpus (on disk when `path` is given)."""
    from . import data
    from .quality import split_tokens
    windows = validate.integer("windows", windows, low=1)
    seq_len = validate.integer("seq_len", seq_len, low=1, high=teacher.config.max_seq_len)
    tokens, _ = split_tokens(tok, "train")
    x, y = data.random_batch(tokens, windows, seq_len, np.random.default_rng([seed, 1 << 20]))
    return TeacherCache.build(teacher, torch.cat([x, y[:, -1:]], dim=1), path, k=k, progress=progress)


def validation_prompts(n: int = 8, lines: int = 4) -> list[str]:
    """Held-out prompts: the first `def` (top level or method) of validation files with the lines after it, n distinct."""
    from .data import read_texts
    n = validate.integer("n", n, low=1)
    lines = validate.integer("lines", lines, low=1)
    prompts, seen = [], set()
    for text in read_texts("val"):
        rows = text.splitlines()
        start = next((i for i, row in enumerate(rows) if row.startswith(("def ", "    def "))), None)
        if start is not None and len(rows) >= start + lines and rows[start] not in seen:
            seen.add(rows[start])                  # codec modules repeat one template: keep one of each
            prompts.append("\n".join(rows[start:start + lines]) + "\n")
        if len(prompts) == n:
            break
    return prompts


def draft_acceptance(target, draft, tok, prompts, k: int = 4, new_tokens: int = 48) -> float:
    """Greedy acceptance rate alpha of `draft` proposing k tokens to `target`, over `prompts`."""
    from .speculative import SpeculativeOutput, speculative_generate
    rounds = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)], device=next(target.parameters()).device)
        rounds += speculative_generate(target, draft, ids, k=k, max_new_tokens=new_tokens,
                                       stop_at_eos=False).rounds
    return SpeculativeOutput([], k, rounds, 0, 0, 0.0).acceptance_rate
