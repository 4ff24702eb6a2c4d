"""Where tensors live and how to time them: one place that knows about CUDA and Triton."""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

HAS_CUDA: bool = torch.cuda.is_available()
HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


def get_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The compute dtype for a device: bf16 on CUDA, fp32 on CPU (16-bit matmuls are slow there)."""
    device = torch.device(device) if device is not None else get_device()
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    device = torch.device(device) if device is not None else get_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def triton_mode() -> str:
    """'compiled' (CUDA), 'interpreter' (TRITON_INTERPRET=1) or 'unavailable'."""
    if not HAS_TRITON:
        return "unavailable"
    if HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        return "compiled"
    return "interpreter"


def describe() -> dict[str, str]:
    """Python, torch, device and Triton, for `infopt-lab doctor` and notebook headers."""
    dev = get_device()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "device": f"{dev} ({name})", "threads": str(torch.get_num_threads()),
            "triton": triton_mode()}
