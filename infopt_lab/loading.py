"""`load_model`: a bundled model, the real model (fetched once, see hub.py), a local Hugging Face
directory, or (online) a hub id."""
from __future__ import annotations

from pathlib import Path

import torch

from . import hub, validate
from .data import SPECIAL_TOKEN, load_tokenizer
from .device import default_dtype, get_device
from .model import Transformer, fuse_projections, set_weight_layout

ASSETS = Path(__file__).parent / "assets" / "models"
BUNDLED = ("target", "draft", "smollm2-135m-draft")
NAMES = BUNDLED[:2] + tuple(hub.REMOTE) + BUNDLED[2:]    # every name load_model knows without a path
DRAFT_OF = {"target": "draft", "smollm2-135m": "smollm2-135m-draft"}   # each model's bundled speculative draft
# how each bundled model is remade (model_card.py writes the same commands into its card)
RECIPE_OF = {"target": ("target",), "draft": ("draft", "draft-distill"),
             "smollm2-135m-draft": ("smollm2-draft", "smollm2-draft-distill")}


def reproduce_commands(name: str, out: str | Path | None = None) -> list[str]:
    """The `infopt-lab train` commands that remake a bundled model into `out` (its bundled folder by default)."""
    out = out or f"infopt_lab/assets/models/{name}"
    tok = " --tokenizer infopt_lab/assets/models/target" if name == "draft" else ""
    first, *rest = RECIPE_OF[name]
    if not rest:
        return [f"infopt-lab train --preset {first} --out {out}{tok}"]
    return [f"infopt-lab train --preset {first} --out runs/{name}-pretrain{tok}",
            f"infopt-lab train --preset {rest[0]} --init runs/{name}-pretrain --out {out}{tok}"]


def bundled_model_dir(name: str) -> Path:
    """Directory of a bundled model ('target' or 'draft')."""
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled model {name!r}; choose one of {list(BUNDLED)}")
    return ASSETS / name


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """The local directory for a bundled name, a path, or a downloaded hub id."""
    validate.instance("the model", name_or_path, (str, Path), "named by a string or a path")
    name = str(name_or_path)
    if not name.strip():
        raise ValueError(f"the model name is empty: use one of {list(NAMES)}, a local directory in "
                         "Hugging Face format, or a hub id")
    if name in BUNDLED:
        path = bundled_model_dir(name)
        if not (path / "model.safetensors").exists():
            raise FileNotFoundError(f"the bundled {name!r} model is missing from {path}; retrain it with "
                                    + " && ".join(f"`{c}`" for c in reproduce_commands(name)))
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
    if device.type == "cpu" and dtype == torch.float32:
        # MKL's fp32 matrix-vector product streams column-major weights faster (model.py); its bf16 one
        # crawls over them (several times slower than over row-major ones, measured on an AVX2 CPU)
        set_weight_layout(model, "column")
    fuse_projections(model)      # q, k, v and gate, up as one product each: same weights, fewer calls
    return model, load_tokenizer_dir(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def load_tokenizer_dir(path: str | Path):
    """A model directory's tokenizer: the course's own through `data.load_tokenizer`, any other through AutoTokenizer."""
    path = Path(path)
    if _course_tokenizer(path):
        return load_tokenizer(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


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
