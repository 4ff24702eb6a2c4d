"""The package's shape: a documented public API, one attention contract, one sampler."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import infopt_lab as lab

PACKAGE = Path(lab.__file__).parent
VALUES = {"PRESETS", "HAS_CUDA", "HAS_TRITON"}   # data, documented where they are defined


def test_every_public_name_exists_and_has_a_one_line_docstring():
    missing = [n for n in lab.__all__ if not hasattr(lab, n)]
    assert not missing, missing
    undocumented = [n for n in lab.__all__ if n not in VALUES
                    and not (inspect.getdoc(getattr(lab, n)) or "").strip().splitlines()[0:1]]
    assert not undocumented, undocumented
    generated = [n for n in lab.__all__ if inspect.isclass(getattr(lab, n))
                 and (inspect.getdoc(getattr(lab, n)) or "").startswith(f"{n}(")]     # a dataclass's signature
    assert not generated, generated


def source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_the_model_never_asks_which_cache_it_has():
    model = source(PACKAGE / "model.py")
    assert "getattr(cache" not in model and "isinstance(cache" not in model and "paged" not in model
    assert "cache.attend(" in model


def test_one_sampler_one_causal_mask():
    """torch.multinomial is called in one place (sampling.draw); the causal mask is built in one place."""
    files = [p for p in PACKAGE.rglob("*.py") if "grading" not in p.parts]
    draws = [p.relative_to(PACKAGE).as_posix() for p in files for _ in re.findall(r"torch\.multinomial\(", source(p))]
    assert draws == ["sampling.py"]
    masks = [p.relative_to(PACKAGE).as_posix() for p in files
             if re.search(r"arange\([^)]*\)\[None, :\] <=", source(p))]
    assert masks == ["attention.py"]
