"""`infopt-lab doctor`: what this machine offers the course, and what is wrong with it."""
from __future__ import annotations

import json
import sys

from .device import describe, triton_mode
from .loading import ASSETS, BUNDLED


def _bundled_models() -> tuple[list[str], list[str]]:
    lines, problems = [], []
    for name in BUNDLED:
        path = ASSETS / name
        weights = path / "model.safetensors"
        missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md")
                   if not (path / f).exists()]
        if missing:
            problems.append(f"bundled model {name!r} lacks {', '.join(missing)} in {path}")
            continue
        config = json.loads((path / "config.json").read_text())
        lines.append(f"{name:<7}: {weights.stat().st_size / 2**20:.1f} MiB on disk, "
                     f"{config['num_hidden_layers']} layers x {config['hidden_size']} wide, "
                     f"vocab {config['vocab_size']}, context {config['max_position_embeddings']}")
    return lines, problems


def _q8_kernel() -> str:
    """How a quantized decode step's hand-written kernel (lab.use_q8_kernel) runs here, or why it does not:
    optional, so never a problem (PyTorch's kernels serve without it)."""
    from . import cpu_q8
    if cpu_q8.why_not() is not None:
        return f"the hand-written int8-activation kernel does not run here ({cpu_q8.why_not()}); PyTorch's kernels serve"
    if cpu_q8.native_why_not() is not None:
        return f"built; compiled steps call it through its Python registration ({cpu_q8.native_why_not()})"
    return "built, with its C++ operators (compiled steps call it without Python)"


def run_doctor() -> int:
    """Print the report; exit status 1 when a problem was found."""
    problems = []
    info = describe()
    for key, value in info.items():
        print(f"{key:<8}: {value}")
    if triton_mode() == "unavailable":
        if sys.platform.startswith("linux"):   # requirements.txt installs Triton on Linux
            problems.append("triton is not installed: kernels fall back to their PyTorch references; "
                            "run `pip install -r requirements.txt`")
        else:
            print(f"note    : no Triton on {sys.platform} (expected): kernels use their PyTorch references")
    print(f"q8      : {_q8_kernel()}")
    lines, model_problems = _bundled_models()
    print("models  :")
    for line in lines:
        print(f"  {line}")
    problems += model_problems
    from . import hub
    for name in hub.REMOTE:
        state = "cached" if hub.is_cached(name) else "not fetched yet: `infopt-lab fetch` (about 93 MB, once)"
        print(f"  {name}: {state}")
    print(f"cache   : {hub.cache_root()} ({hub.cache_size_bytes() / 2**20:.0f} MiB)"
          + ("; downloads off" if hub.offline() else ""))
    from .lowering import verdicts_summary
    print(f"compile : {verdicts_summary()}")
    try:
        from .loading import load_model
        model, tok = load_model("target") if not model_problems else (None, None)
        if model is not None:
            ids = tok.encode("def f(x):")
            if tok.decode(ids, skip_special_tokens=True) != "def f(x):":
                problems.append("the target tokenizer does not round-trip text")
    except Exception as e:   # report, do not crash: doctor exists to describe breakage
        problems.append(f"loading the target failed: {type(e).__name__}: {e}")
    if problems:
        print(f"{len(problems)} problem(s):")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("no problems found")
    return 0
