"""`load_model`: a bundled model, the real model (fetched once, see hub.py), a local Hugging Face
directory, or (online) a hub id."""
from __future__ import annotations

from pathlib import Path

import torch

from . import hub
from .data import SPECIAL_TOKEN, load_tokenizer
from .device import default_dtype, get_device
from .model import Transformer, fuse_projections, set_weight_layout

ASSETS = Path(__file__).parent / "assets" / "models"
BUNDLED = ("target", "draft")
NAMES = BUNDLED + tuple(hub.REMOTE)          # every name load_model knows without a path


def bundled_model_dir(name: str) -> Path:
    """Directory of a bundled model ('target' or 'draft')."""
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled model {name!r}; choose one of {list(BUNDLED)}")
    return ASSETS / name


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """The local directory for a bundled name, a path, or a downloaded hub id."""
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"the model must be named by a string or a path, got {type(name_or_path).__name__}")
    name = str(name_or_path)
    if not name.strip():
        raise ValueError(f"the model name is empty: use one of {list(NAMES)}, a local directory in "
                         "Hugging Face format, or a hub id")
    if name in BUNDLED:
        path = bundled_model_dir(name)
        if not (path / "model.safetensors").exists():
            raise FileNotFoundError(f"the bundled {name!r} model is missing from {path}; "
                                    f"retrain it with `infopt-lab train --preset {name} --out {path}`")
        return path
    if name in hub.REMOTE:
        return hub.ensure(name)
    try:
        path = Path(name).expanduser()
    except RuntimeError as e:            # "~user" for a user this machine does not have
        raise ValueError(f"unknown model {name!r}: {e}") from None
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} is not a model directory in Hugging Face format: it has no config.json")
        return path
    if "/" not in name or name.startswith((".", "/", "~")):
        raise ValueError(f"unknown model {name!r}: use one of {list(NAMES)}, a local directory in "
                         f"Hugging Face format, or a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct' "
                         f"(needs the Hugging Face hub)")
    from huggingface_hub import snapshot_download   # hub ids only: never needed offline
    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))


def load_model(name_or_path: str | Path = "target", dtype: torch.dtype | None = None,
               device: torch.device | str | None = None):
    """(model, tokenizer): fp32 on CPU and bf16 on CUDA unless `dtype` says otherwise."""
    path = resolve_model_dir(name_or_path)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch dtype such as torch.float32 or torch.bfloat16, got {dtype!r}")
    device = torch.device(device) if device is not None else get_device()
    dtype = dtype or default_dtype(device)
    model = Transformer.from_pretrained(path, dtype=dtype, device=device)
    if device.type == "cpu":     # the CPU's matrix-vector product streams column-major weights faster (model.py)
        set_weight_layout(model, "column")
    fuse_projections(model)      # q, k, v and gate, up as one product each: same weights, fewer calls
    if _course_tokenizer(path):
        tok = load_tokenizer(path)
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)
    return model, tok


def _course_tokenizer(path: Path) -> bool:
    """Whether the directory holds a tokenizer the course's recipe trained (its one special token)."""
    import json
    cfg = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").exists() or not cfg.exists():
        return False
    try:
        cfg = json.loads(cfg.read_text())
    except ValueError:
        return False
    return cfg.get("tokenizer_class") == "PreTrainedTokenizerFast" and cfg.get("eos_token") == SPECIAL_TOKEN
