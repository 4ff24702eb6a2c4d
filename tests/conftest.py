"""Shared fixtures: a tiny random model in the bundled format, and the bundled models.

Also the one switch the kernel tests need: Triton's interpreter on a machine without CUDA, and the
hypothesis profile every property-based suite runs under.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch  # torch does not import triton, so asking it about CUDA here is still early enough
from hypothesis import settings

# Hypothesis profiles. "ci", loaded by default (CI and a laptop alike), draws the same examples on every run
# (derandomize=True: seeded by a hash of each test) and keeps no example database, so a red CI run is replayed
# exactly by running the same test again; print_blob=True prints the failing example's @reproduce_failure blob.
# HYPOTHESIS_PROFILE=explore draws new random examples each run (still printing the blob) to hunt for new bugs;
# HYPOTHESIS_PROFILE=default is hypothesis' own. Only these settings come from the profile: each test keeps its
# own max_examples, deadline and health checks (`@settings(...)` in the test file overrides just those). This
# file is imported before any test module, so their `settings(...)` objects inherit the profile loaded here.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

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
def _tiny_model(tiny_dir):
    import infopt_lab as lab
    return lab.load_model(tiny_dir)


def _fingerprint(model):
    """What a test must not change in the shared model: dtypes, the tied head, every weight's sum."""
    with torch.no_grad():
        return ({p.dtype for p in model.parameters()}, model.lm_head.weight is model.embed_tokens.weight,
                [float(t.double().sum()) for t in model.state_dict().values()])


@pytest.fixture
def tiny(_tiny_model):
    """The tiny model and tokenizer, loaded once per worker and shared: a test that needs to change the model
    (cast it, quantize it in place, train it) works on a copy. One that changes the shared model fails here, by
    name, instead of a later test on the same worker failing for no reason of its own."""
    before = _fingerprint(_tiny_model[0])
    yield _tiny_model
    assert _fingerprint(_tiny_model[0]) == before, "this test changed the shared `tiny` model; work on a copy"
