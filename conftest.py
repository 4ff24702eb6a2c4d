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
