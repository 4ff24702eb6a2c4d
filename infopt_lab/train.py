"""A training run of a recipe (recipe.py), behind `infopt-lab train`: seeded, resumable, CPU or CUDA.

A run writes, into its output directory, the tokenizer, a resumable checkpoint
(`checkpoint/`, safetensors plus JSON, no pickle), a log of val bits per byte
(`train_log.jsonl`) and, when it finishes, the model in the Hugging Face Llama
format. Rerunning the same command resumes from the checkpoint.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import data
from .config import get_preset
from .device import bf16_autocast, get_device, keep_freed_memory
from .distill import TeacherCache, distillation_loss
from .model import Transformer
from .recipe import RECIPES, Recipe, lr_at, optimizer, update, val_bits_per_byte  # noqa: F401  (re-exported: cli)


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
    """One optimizer step under bf16 autocast where the device has bf16 (`device.bf16_autocast`); returns the loss.

    The teacher's logits come from `teacher` run on this batch, or from `cached` (values, indices [B, T, k]).
    """
    with bf16_autocast(x.device):
        logits = model(x)                                              # (B, T, V)
    t_logits, t_indices = None, None
    if cached is not None:
        t_logits, t_indices = (c.flatten(0, 1) for c in cached)        # (B*T, k) each
    elif teacher is not None:
        with torch.inference_mode(), bf16_autocast(x.device):
            t_logits = teacher(x).float().flatten(0, 1).clone()        # (B*T, V)
    if t_logits is None:
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    else:
        loss = distillation_loss(logits.flatten(0, 1), y.flatten(), t_logits, t_indices,
                                 recipe.distill_weight, recipe.temperature)
    update(model, opt, loss, lr, recipe)
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
    model = _student(recipe, len(tok), device)
    teacher, cache = _teacher(out, recipe, train_tokens, device, progress)
    opt = optimizer(model, recipe)
    ckpt = out / "checkpoint"
    step, elapsed = _resume(ckpt, model, opt)
    if keep_memory:
        keep_freed_memory()       # after the teacher's cache: its passes fragment a heap that never shrinks
    t0 = time.perf_counter() - elapsed
    end = recipe.steps if stop_after is None else min(recipe.steps, stop_after)
    with (out / "train_log.jsonl").open("a") as log, \
            tqdm(total=recipe.steps, initial=step, disable=not progress, desc=f"train {recipe.preset}") as bar:
        while step < end:
            x, y, cached = _batch(recipe, step, train_tokens, cache, device)
            loss = _train_step(model, opt, x, y, lr_at(step, recipe), recipe, teacher, cached)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if step % recipe.eval_every == 0 or step == recipe.steps:
                bpb = val_bits_per_byte(model, val_windows, byte_lengths)
                elapsed = time.perf_counter() - t0
                _log_evaluation(log, bar, recipe, step, loss, bpb, elapsed)
                save_checkpoint(ckpt, model, opt, step, recipe, elapsed)
    if step < recipe.steps:
        return out                                             # stopped early: resume later
    _finish(out, recipe, model, cache is not None)
    return out


def _student(recipe: Recipe, vocab_size: int, device: torch.device) -> Transformer:
    """The model to train: freshly initialised from the seeded generator, or the weights of `recipe.init_from`."""
    config = get_preset(recipe.preset)
    config.vocab_size = vocab_size
    model = Transformer(config).to(device).train()
    if recipe.init_from is not None:
        start = Transformer.from_pretrained(recipe.init_from)
        if start.config != config:
            raise ValueError(f"--init {recipe.init_from} holds a {start.config} model, the recipe needs {config}")
        model.load_state_dict(start.state_dict())
    return model


def _teacher(out: Path, recipe: Recipe, train_tokens, device: torch.device,
             progress: bool) -> tuple[Transformer | None, TeacherCache | None]:
    """The recipe's teacher, run on every batch, or its top-k cache on fixed windows; (None, None) without one."""
    if recipe.teacher is None:
        return None, None
    from .loading import load_model
    teacher = load_model(recipe.teacher, dtype=torch.float32, device=device)[0].eval()
    if not recipe.teacher_topk:
        return teacher, None
    rng = np.random.default_rng([recipe.seed, 1 << 20])       # not a step's stream
    x, y = data.random_batch(train_tokens, recipe.teacher_windows, recipe.seq_len, rng)
    windows = torch.cat([x, y[:, -1:]], dim=1)                 # (N, T + 1)
    cache = TeacherCache.build(teacher, windows, out / "teacher-topk", k=recipe.teacher_topk,
                               fingerprint={"teacher": recipe.teacher, **teacher.config.to_dict()},
                               progress=progress)
    return None, cache                                         # epochs read the cache, not the teacher


def _resume(ckpt: Path, model: Transformer, opt: torch.optim.Optimizer) -> tuple[int, float]:
    """The step and elapsed seconds to continue from: the checkpoint's (loaded into model and opt), or 0."""
    if not (ckpt / "state.json").exists():
        return 0, 0.0
    meta = load_checkpoint(ckpt, model, opt)
    print(f"resuming from step {meta['step']}")
    return meta["step"], meta["elapsed_s"]


def _batch(recipe: Recipe, step: int, train_tokens, cache: TeacherCache | None, device: torch.device):
    """Step `step`'s inputs and targets [B, T] on `device`, and the cached teacher's values and indices (or None)."""
    rng = np.random.default_rng([recipe.seed, step])   # the batch depends only on the step
    cached = None
    if cache is not None:
        x, y, *cached = cache.batch(rng, recipe.batch_size)
        cached = [c.to(device) for c in cached]
    else:
        x, y = data.random_batch(train_tokens, recipe.batch_size, recipe.seq_len, rng)
    return x.to(device), y.to(device), cached


def _log_evaluation(log, bar, recipe: Recipe, step: int, loss: float, bpb: float, elapsed: float) -> None:
    """One line of train_log.jsonl, and the same numbers printed under the progress bar."""
    entry = {"step": step, "train_loss": round(loss, 4), "val_bpb": round(bpb, 4),
             "tokens": step * recipe.batch_size * recipe.seq_len, "elapsed_s": round(elapsed, 1)}
    log.write(json.dumps(entry) + "\n")
    log.flush()
    bar.write(f"step {step}: train loss {loss:.3f}, val bits/byte {bpb:.3f}")


def _finish(out: Path, recipe: Recipe, model: Transformer, cached_teacher: bool) -> None:
    """The finished model in the Hugging Face format and its provenance replace the resumable state."""
    model.save_pretrained(out)
    _write_provenance(out, recipe)
    shutil.rmtree(out / "checkpoint")
    if cached_teacher:
        shutil.rmtree(out / "teacher-topk")                    # hundreds of MB, rebuilt by rerunning the recipe


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
