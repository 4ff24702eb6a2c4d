"""pytest at the root: one thread per xdist worker.

`pytest -n auto` starts a worker per core; with PyTorch's default of one thread
per core each, the workers fight over the cores and small-op timings collapse.
The environment variable reaches the notebook kernels the workers start too.
"""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


# The longest files first. xdist hands a worker the next file (a notebook runs whole on one worker) when it
# runs short of work; taken longest first, the last files to finish are short ones, and neither worker
# waits long for the other at the end. Seconds per file summed from `pytest --durations=0` on a 2-core AMD EPYC
# (AVX2, bf16 emulated, 8 MiB last-level cache) of the CI kind, 2026-12-04; a file not listed here runs after
# these, in collection order.
LONGEST_FIRST = {
    "notebooks/02_quantization.ipynb": 440, "notebooks/05_speculative_decoding.ipynb": 439,
    "tests/test_grading.py": 290, "notebooks/06_distillation.ipynb": 252, "notebooks/03_batching.ipynb": 215,
    "notebooks/07_putting_it_together.ipynb": 207, "tests/test_feature_draft.py": 145,
    "tests/test_compiled.py": 125, "notebooks/01_cost_anatomy_kv_cache.ipynb": 123,
    "tests/test_speculative.py": 118, "notebooks/08_serving.ipynb": 112, "tests/test_exactness.py": 96,
    "tests/test_bundled_models.py": 55, "tests/test_train.py": 51, "tests/test_invariant.py": 45,
    "solutions/02_quantization.ipynb": 39,
}


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(sorted(LONGEST_FIRST, key=LONGEST_FIRST.get, reverse=True))}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
