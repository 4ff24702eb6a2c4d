"""Shared fixtures: a tiny random model in the bundled format, and the bundled models.

Also the one switch the kernel tests need: Triton's interpreter on a machine without CUDA.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch  # torch does not import triton, so asking it about CUDA here is still early enough

# Triton reads TRITON_INTERPRET once, when triton itself is first imported; kernels defined after an import
# without it can only be compiled for a GPU, and on a CPU every kernel test would fail. pytest imports this
# file before any test module, so setting it here does not depend on which test module imports what first
# (`import infopt_lab` sets it too, but only if it comes before transformers, torch.compile or `import triton`).
# With CUDA it stays unset: the kernels compile for real there (scripts/gpu_check.sh).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from infopt_lab.config import get_preset  # noqa: E402  (the package, after the switch)
from infopt_lab.loading import ASSETS  # noqa: E402
from infopt_lab.model import Transformer  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A randomly initialised tiny model with the bundled tokenizer, saved in HF format (fp32)."""
    path = tmp_path_factory.mktemp("tiny")
    config = get_preset("tiny")
    config.vocab_size = 4096
    config.max_seq_len = 256
    torch.manual_seed(0)
    Transformer(config).save_pretrained(path, dtype=torch.float32)
    for name in TOKENIZER_FILES:
        shutil.copy(ASSETS / "target" / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    import infopt_lab as lab
    return lab.load_model(tiny_dir)
