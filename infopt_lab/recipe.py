"""A training recipe: a run's settings (`Recipe`, named presets in `RECIPES`) and what they define for the
loop that runs them: the optimizer, its learning-rate schedule, the update step and the val score.

Two loops run a recipe: `train.train` (the command line's, resumable) and `distill.distill` (a
notebook's, in memory). Both import these pieces from here, and neither imports the other's loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import validate
from .model import Transformer
from .quality import score_windows


@dataclass
class Recipe:
    preset: str = "target"
    steps: int = 3000             # optimizer steps
    batch_size: int = 16          # sequences per step
    seq_len: int = 512            # tokens per training sequence
    lr: float = 2e-3              # peak learning rate
    min_lr_ratio: float = 0.05    # cosine floor, as a share of the peak
    warmup: int = 150             # linear warm-up steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 250         # steps between val evaluations and checkpoints
    eval_windows: int = 64        # val windows scored at each evaluation
    seed: int = 0
    vocab_size: int = 4096
    teacher: str | None = None    # a model (bundled name or directory) whose next-token distributions are distilled
    distill_weight: float = 0.0   # share of the loss that is KL(teacher || student); the rest is next-token CE
    temperature: float = 1.0      # softens teacher and student alike in the KL term (distill.py)
    teacher_topk: int = 0         # > 0: cache the teacher's top-k logits once on `teacher_windows` windows
    teacher_windows: int = 0      #   and train on those windows (0: run the teacher on every batch)
    tokenizer: str | None = None  # a model whose tokenizer the run uses (None: train one on the corpus)
    init_from: str | None = None  # a model directory whose weights start the run (set by `--init`)

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "warmup", "eval_every", "eval_windows"):
            setattr(self, name, validate.integer(name, getattr(self, name), low=1))
        self.lr = validate.real("lr", self.lr, low=0, high=1, low_open=True)
        self.distill_weight = validate.real("distill_weight", self.distill_weight, low=0, high=1)
        if self.distill_weight > 0 and self.teacher is None:
            raise ValueError("distill_weight > 0 needs a teacher model")
        self.temperature = validate.real("temperature", self.temperature, low=0, low_open=True)
        self.teacher_topk = validate.integer("teacher_topk", self.teacher_topk, low=0)
        self.teacher_windows = validate.integer("teacher_windows", self.teacher_windows, low=0)
        if (self.teacher_topk > 0) != (self.teacher_windows > 0):
            raise ValueError("teacher_topk and teacher_windows must both be positive (a cached teacher) or both 0, "
                             f"got {self.teacher_topk} and {self.teacher_windows}")


RECIPES = {
    "target": Recipe(preset="target", steps=2400),
    "draft": Recipe(preset="draft", steps=1000, lr=3e-3),
    # fine-tunes a trained draft (`--init DIR`) towards the target's distributions: a better speculator
    "draft-distill": Recipe(preset="draft", steps=300, batch_size=8, lr=1e-3, warmup=20, eval_every=50,
                            teacher="target", distill_weight=0.9),
    # SmolLM2-135M's draft: hard labels on the corpus in SmolLM2's tokenization, then (`--init`) distilled
    "smollm2-draft": Recipe(preset="smollm2-draft", steps=600, batch_size=4, seq_len=1024, lr=3e-3, warmup=50,
                            eval_every=100, eval_windows=16, tokenizer="smollm2-135m"),
    "smollm2-draft-distill": Recipe(preset="smollm2-draft", steps=600, batch_size=4, seq_len=1024, lr=1.5e-3,
                                    warmup=30, eval_every=100, eval_windows=16, tokenizer="smollm2-135m",
                                    teacher="smollm2-135m", distill_weight=0.9, teacher_topk=32,
                                    teacher_windows=768),
    "tiny": Recipe(preset="tiny", steps=20, batch_size=4, seq_len=64, eval_every=10,
                   eval_windows=4, vocab_size=512),
}


def lr_at(step: int, r: Recipe) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    progress = min(1.0, (step - r.warmup) / max(1, r.steps - r.warmup))
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer(model: Transformer, r: Recipe) -> torch.optim.AdamW:
    """AdamW with the recipe's weight decay on matrices and none on norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": r.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=r.lr, betas=(0.9, 0.95), eps=1e-8)


def update(model: Transformer, opt: torch.optim.Optimizer, loss: torch.Tensor, lr: float, r: Recipe) -> None:
    """One optimizer step on `loss` at learning rate `lr`: backward, clip to r.grad_clip, step, clear the gradients."""
    for g in opt.param_groups:
        g["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def val_bits_per_byte(model: Transformer, windows: torch.Tensor, byte_lengths: torch.Tensor) -> float:
    """Bits per byte of `windows` ([N, T + 1]) under the model, scored in eval mode; the model is left training."""
    model.eval()
    nats, _, n_bytes = score_windows(model, windows, byte_lengths)
    model.train()
    return nats / math.log(2) / max(1, n_bytes)
