"""The training recipe behind `infopt-lab train`: seeded, resumable, CPU or CUDA.

A run writes, into its output directory, the tokenizer, a resumable checkpoint
(`checkpoint/`, safetensors plus JSON, no pickle), a log of val bits per byte
(`train_log.jsonl`) and, when it finishes, the model in the Hugging Face Llama
format. Rerunning the same command resumes from the checkpoint.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import data
from .config import get_preset
from .device import get_device, keep_freed_memory
from .distill import TeacherCache, distillation_loss
from .quality import score_windows
from .model import Transformer


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
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr}")
        if not 0 <= self.distill_weight <= 1:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}")
        if self.distill_weight > 0 and self.teacher is None:
            raise ValueError("distill_weight > 0 needs a teacher model")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.teacher_topk < 0 or self.teacher_windows < 0 or (self.teacher_topk > 0) != (self.teacher_windows > 0):
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


def _optimizer(model: Transformer, r: Recipe) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": r.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=r.lr, betas=(0.9, 0.95), eps=1e-8)


def save_checkpoint(path: Path, model: Transformer, opt: torch.optim.Optimizer, step: int,
                    recipe: Recipe, elapsed_s: float):
    """Model, optimizer moments and progress, as safetensors and JSON."""
    from safetensors.torch import save_file
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
               or not model.config.tie_embeddings}, str(tmp / "model.safetensors"))
    opt_state = opt.state_dict()
    tensors = {}
    for idx, st in opt_state["state"].items():
        for key, val in st.items():
            tensors[f"{idx}.{key}"] = torch.as_tensor(val).contiguous()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    groups = [{k: v for k, v in g.items()} for g in opt_state["param_groups"]]
    meta = {"step": step, "elapsed_s": elapsed_s, "recipe": asdict(recipe), "param_groups": groups,
            "config": model.config.to_dict()}
    (tmp / "state.json").write_text(json.dumps(meta, indent=2))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def load_checkpoint(path: Path, model: Transformer, opt: torch.optim.Optimizer) -> dict:
    from safetensors.torch import load_file
    meta = json.loads((path / "state.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    if model.config.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state)
    tensors = load_file(str(path / "optimizer.safetensors"))
    opt_state: dict = {"state": {}, "param_groups": meta["param_groups"]}
    for name, val in tensors.items():
        idx, key = name.split(".", 1)
        opt_state["state"].setdefault(int(idx), {})[key] = val
    opt.load_state_dict(opt_state)
    return meta


def evaluate(model: Transformer, windows: torch.Tensor, byte_lengths: torch.Tensor) -> float:
    """Bits per byte of `windows` ([N, T + 1]) under the model."""
    model.eval()
    nats, _, n_bytes = score_windows(model, windows, byte_lengths)
    model.train()
    return nats / math.log(2) / max(1, n_bytes)


def _prepare_data(out: Path, recipe: Recipe, tokenizer_dir: str | Path | None):
    """The run's tokenizer (trained once, or copied), train tokens, val windows, token byte lengths."""
    from .loading import TOKENIZER_FILES, load_tokenizer_dir, resolve_model_dir
    if tokenizer_dir is None and recipe.tokenizer is not None:
        tokenizer_dir = resolve_model_dir(recipe.tokenizer)
    if not (out / "tokenizer.json").exists():
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).exists():
                    shutil.copy(Path(tokenizer_dir) / name, out / name)
        else:
            data.save_tokenizer(data.train_tokenizer(recipe.vocab_size), out)
    tok = load_tokenizer_dir(out)
    train_tokens, _ = data.encode_split(tok, "train")
    val_tokens, _ = data.encode_split(tok, "val")
    val_windows = data.eval_windows(val_tokens, recipe.seq_len, recipe.eval_windows)
    return tok, train_tokens, val_windows, data.token_byte_lengths(tok)


def _train_step(model, opt, x, y, lr: float, recipe: Recipe, teacher=None, cached=None) -> float:
    """One optimizer step under bf16 autocast; returns the loss.

    The teacher's logits come from `teacher` run on this batch, or from `cached` (values, indices [B, T, k]).
    """
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(x)                                              # (B, T, V)
    t_logits, t_indices = None, None
    if cached is not None:
        t_logits, t_indices = (c.flatten(0, 1) for c in cached)        # (B*T, k) each
    elif teacher is not None:
        with torch.inference_mode(), torch.autocast(x.device.type, dtype=torch.bfloat16):
            t_logits = teacher(x).float().flatten(0, 1).clone()        # (B*T, V)
    if t_logits is None:
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    else:
        loss = distillation_loss(logits.flatten(0, 1), y.flatten(), t_logits, t_indices,
                                 recipe.distill_weight, recipe.temperature)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def train(recipe: Recipe, out: str | Path, tokenizer_dir: str | Path | None = None,
          device: torch.device | None = None, progress: bool = True,
          stop_after: int | None = None, keep_memory: bool = False) -> Path:
    """Train (or resume) a model of `recipe.preset` into `out`; returns `out`.

    `stop_after` ends the run early at that step, leaving the checkpoint to resume from.
    `keep_memory` asks the allocator to keep freed memory for the training loop (`device.keep_freed_memory`:
    process-wide, so the command line sets it, not a notebook).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = device or get_device()
    torch.manual_seed(recipe.seed)
    tok, train_tokens, val_windows, byte_lengths = _prepare_data(out, recipe, tokenizer_dir)
    config = get_preset(recipe.preset)
    config.vocab_size = len(tok)
    model = Transformer(config).to(device).train()
    if recipe.init_from is not None:
        start = Transformer.from_pretrained(recipe.init_from)
        if start.config != config:
            raise ValueError(f"--init {recipe.init_from} holds a {start.config} model, the recipe needs {config}")
        model.load_state_dict(start.state_dict())
    teacher, cache = None, None
    if recipe.teacher is not None:
        from .loading import load_model
        teacher = load_model(recipe.teacher, dtype=torch.float32, device=device)[0].eval()
        if recipe.teacher_topk:
            rng = np.random.default_rng([recipe.seed, 1 << 20])       # not a step's stream
            x, y = data.random_batch(train_tokens, recipe.teacher_windows, recipe.seq_len, rng)
            windows = torch.cat([x, y[:, -1:]], dim=1)                 # (N, T + 1)
            cache = TeacherCache.build(teacher, windows, out / "teacher-topk", k=recipe.teacher_topk,
                                       fingerprint={"teacher": recipe.teacher, **teacher.config.to_dict()},
                                       progress=progress)
            teacher = None                                             # epochs read the cache, not the teacher
    opt = _optimizer(model, recipe)
    ckpt = out / "checkpoint"
    step, elapsed = 0, 0.0
    if (ckpt / "state.json").exists():
        meta = load_checkpoint(ckpt, model, opt)
        step, elapsed = meta["step"], meta["elapsed_s"]
        print(f"resuming from step {step}")

    if keep_memory:
        keep_freed_memory()       # after the teacher's cache: its passes fragment a heap that never shrinks
    t0 = time.perf_counter() - elapsed
    with (out / "train_log.jsonl").open("a") as log, \
            tqdm(total=recipe.steps, initial=step, disable=not progress, desc=f"train {recipe.preset}") as bar:
        while step < recipe.steps and (stop_after is None or step < stop_after):
            rng = np.random.default_rng([recipe.seed, step])   # the batch depends only on the step
            cached = None
            if cache is not None:
                x, y, *cached = cache.batch(rng, recipe.batch_size)
                cached = [c.to(device) for c in cached]
            else:
                x, y = data.random_batch(train_tokens, recipe.batch_size, recipe.seq_len, rng)
            loss = _train_step(model, opt, x.to(device), y.to(device), lr_at(step, recipe), recipe, teacher, cached)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if step % recipe.eval_every == 0 or step == recipe.steps:
                bpb = evaluate(model, val_windows, byte_lengths)
                elapsed = time.perf_counter() - t0
                entry = {"step": step, "train_loss": round(loss, 4), "val_bpb": round(bpb, 4),
                         "tokens": step * recipe.batch_size * recipe.seq_len, "elapsed_s": round(elapsed, 1)}
                log.write(json.dumps(entry) + "\n")
                log.flush()
                bar.write(f"step {step}: train loss {loss:.3f}, val bits/byte {bpb:.3f}")
                save_checkpoint(ckpt, model, opt, step, recipe, elapsed)
    if step < recipe.steps:
        return out                                             # stopped early: resume later
    model.save_pretrained(out)
    _write_provenance(out, recipe)
    shutil.rmtree(ckpt)                                        # the finished model replaces the resumable state
    if cache is not None:
        shutil.rmtree(out / "teacher-topk")                    # hundreds of MB, rebuilt by rerunning the recipe
    return out


def _write_provenance(out: Path, recipe: Recipe) -> None:
    """recipe.json, and for a run started from another (`--init`) that run's recipe and log as its first stage."""
    meta = asdict(recipe)
    init = Path(recipe.init_from) if recipe.init_from else None
    if init is not None and (init / "recipe.json").exists() and (init / "train_log.jsonl").exists():
        meta["init_recipe"] = json.loads((init / "recipe.json").read_text())
        before = [json.loads(line) for line in (init / "train_log.jsonl").read_text().splitlines()]
        after = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        lines = [{**e, "stage": e.get("stage", "pretrain")} for e in before] + [{**e, "stage": "distill"} for e in after]
        (out / "train_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    (out / "recipe.json").write_text(json.dumps(meta, indent=2) + "\n")
