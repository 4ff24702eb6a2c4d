"""Where tensors live and how to time them: one place that knows about CUDA and Triton."""
from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

HAS_CUDA: bool = torch.cuda.is_available()
HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


def get_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


BF16_FROM = (8, 0)   # compute capability with bf16 in hardware (Ampere); a T4 (7.5) only emulates it


def capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """The CUDA compute capability of a device, (8, 0) for an A100; None for a CPU."""
    device = torch.device(device) if device is not None else get_device()
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def supported_dtypes(cap: tuple[int, int] | None) -> tuple[torch.dtype, ...]:
    """The dtypes the kernels run in on a device of compute capability `cap` (None: a CPU, Triton's interpreter).

    bf16 only where the GPU has it natively (capability >= 8.0). `torch.cuda.is_bf16_supported()` is
    not asked: it answers True on a T4, where bf16 is emulated. The interpreter has no bf16 at all.
    """
    if cap is not None and tuple(cap) >= BF16_FROM:
        return torch.float32, torch.float16, torch.bfloat16
    return torch.float32, torch.float16


def default_dtype(device: torch.device | str | None = None, cap: tuple[int, int] | None = None) -> torch.dtype:
    """The compute dtype for a device: the one place that decides it.

    fp32 on a CPU (16-bit matmuls are slow there); on CUDA bf16 where the GPU has it (capability
    >= 8.0: A100, L4, H100), fp16 below (a T4). `cap` stands in for the device's own capability.
    """
    device = torch.device(device) if device is not None else get_device()
    if device.type != "cuda":
        return torch.float32
    cap = cap if cap is not None else capability(device)
    return torch.bfloat16 if torch.bfloat16 in supported_dtypes(cap) else torch.float16


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); empty where they cannot be read.

    Read once: training asks at every step.
    """
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX, Linux flags); False where it cannot tell."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def has_native_bf16(device: torch.device | str) -> bool:
    """bf16 in hardware: a GPU of capability >= 8.0, or a CPU with AVX512-BF16/AMX.

    Elsewhere bf16 arithmetic is emulated in software, many times slower than fp32.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 in supported_dtypes(capability(device))
    return cpu_has_native_bf16()


def bf16_autocast(device: torch.device | str) -> torch.autocast:
    """bf16 autocast for training and teacher passes where the device has bf16 in hardware, fp32 elsewhere."""
    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=has_native_bf16(device))


def check_dtype(dtype: torch.dtype, cap: tuple[int, int] | None, what: str = "this kernel") -> None:
    """Refuse a dtype the device of capability `cap` cannot run, naming the ones it can."""
    allowed = supported_dtypes(cap)
    if dtype not in allowed:
        where = "a CPU (Triton's interpreter)" if cap is None else f"a GPU of compute capability {cap[0]}.{cap[1]}"
        raise ValueError(f"{what} cannot run in {dtype} on {where}: allowed are "
                         f"{', '.join(str(d).removeprefix('torch.') for d in allowed)}")


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of returning it to the system; whether it could.

    A training step allocates and frees tensors of hundreds of MB (the logits over a 49,152-token
    vocabulary). glibc hands each one back to the system and the next step faults every page in
    again, which on a 2-core CPU cost more time than the arithmetic. This is process-wide and keeps
    the process's memory at its peak, so only the `infopt-lab train` command asks for it, and only
    for its training loop: a loop whose steps allocate alike reuses the same memory, while a run of
    varied large allocations (the teacher's cache, 49,152-wide logits at changing sizes) can grow
    the heap without bound.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4    # mallopt parameters (malloc.h); values are C ints
        most = 2**31 - 1
        return all(libc.mallopt(param, value) for param, value in
                   ((m_mmap_max, 0), (m_trim_threshold, most), (m_top_pad, most)))
    except (OSError, AttributeError):                           # not glibc (musl, for one)
        return False


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


def cpu_name() -> str:
    """The processor's model name ("AMD EPYC 9R14", ...), or the platform's word for it."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache (Linux sysfs), or None where it cannot be read."""
    sizes = []
    for index in range(8):
        path = f"/sys/devices/system/cpu/cpu0/cache/index{index}/size"
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes) if sizes else None


def describe() -> dict[str, str]:
    """Python, torch, device (which CPU, its vector units and cache) and Triton, for doctor and notebook headers."""
    dev = get_device()
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
        cache = last_level_cache_bytes()
        name = f"{cpu_name()}, {capability}" + (f", {cache / 2**20:.0f} MiB last-level cache" if cache else "")
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "device": f"{dev} ({name})", "threads": str(torch.get_num_threads()),
            "triton": triton_mode()}


def available_memory_bytes(device: torch.device | str | None = None) -> tuple[int, str]:
    """Bytes a new allocation can take on a device, and where the figure comes from.

    CUDA: the free memory the driver reports. CPU: the memory the system says is available,
    or what is left under this process's cgroup limit when that is smaller (containers, CI).
    """
    device = torch.device(device) if device is not None else get_device()
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free memory on {device}"
    import psutil
    best, source = psutil.virtual_memory().available, "available system memory"
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = open(limit_file).read().strip()
            usage = int(open(usage_file).read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) - usage < best:
            best, source = max(0, int(limit) - usage), "memory left under this process's cgroup limit"
    return best, source


ALLOCATION_SHARE = 0.9   # of the free memory one buffer may take: the rest keeps the machine (and the kernel) alive


def check_allocation(nbytes: int, what: str, device: torch.device | str | None = None) -> None:
    """Refuse, before allocating, a buffer larger than 90% of the memory the device has left (naming both)."""
    free, source = available_memory_bytes(device)
    if nbytes > ALLOCATION_SHARE * free:
        raise ValueError(f"{what} would need {nbytes / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free "
                         f"({source}; one buffer may take {ALLOCATION_SHARE:.0%} of it); ask for fewer blocks, "
                         "a smaller batch or a shorter context")
