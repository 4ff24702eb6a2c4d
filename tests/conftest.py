"""Shared fixtures: a tiny random model in the bundled format, and the bundled models."""
from __future__ import annotations

import shutil

import pytest
import torch

from infopt_lab.config import get_preset
from infopt_lab.loading import ASSETS
from infopt_lab.model import Transformer

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
