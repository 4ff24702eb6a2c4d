"""The `infopt-lab` command: doctor, fetch, card, bench, train, serve, loadtest, assign, grade."""
from __future__ import annotations

import argparse
import sys


def _cmd_train(args) -> int:
    from dataclasses import replace
    from .train import RECIPES, train
    recipe = RECIPES[args.preset]
    if args.steps is not None:
        recipe = replace(recipe, steps=args.steps)
    if args.init is not None:
        recipe = replace(recipe, init_from=str(args.init))
    train(recipe, args.out, tokenizer_dir=args.tokenizer, keep_memory=True)
    print(f"saved {args.preset} model to {args.out}")
    return 0


def _cmd_doctor(args) -> int:
    from .doctor import run_doctor
    return run_doctor()


def _cmd_fetch(args) -> int:
    from . import hub
    if args.clear:
        freed = hub.clear()
        print(f"removed {freed / 2**20:.0f} MiB from {hub.cache_root()}")
        return 0
    unknown = [m for m in args.models if m not in hub.REMOTE]
    if unknown:
        raise ValueError(f"unknown model {unknown}; choose from {sorted(hub.REMOTE)}")
    for name in args.models:
        path = hub.fetch(name)
        print(f"{name}: ready in {path}")
    return 0


def _cmd_bench(args) -> int:
    if args.ladder:
        from .bench.ladder import ladder_command
        if args.only:
            print("infopt-lab bench: error: --ladder runs its own rungs; drop --only", file=sys.stderr)
            return 2
        ladder_command("smollm2-135m" if args.model is None else args.model, args.json, args.price_per_hour)
        return 0
    from .bench import REAL_ONLY_RUNGS, run
    if args.json is not None:
        print("infopt-lab bench: error: --json writes the ladder's rungs; use it with --ladder", file=sys.stderr)
        return 2
    real_only = bool(args.only) and all(n in REAL_ONLY_RUNGS for n in args.only)
    model = args.model if args.model is not None else "smollm2-135m" if args.against or real_only else "target"
    try:
        run(only=args.only, against=args.against, model_name=model)
    except ValueError as e:
        print(f"infopt-lab bench: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_card(args) -> int:
    from .loading import BUNDLED
    from .model_card import write_cards
    unknown = [m for m in args.models if m not in BUNDLED]
    if unknown:
        print(f"infopt-lab card: error: unknown model {unknown}; choose from {list(BUNDLED)}", file=sys.stderr)
        return 2
    write_cards(args.models)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .train import RECIPES
    parser = argparse.ArgumentParser(prog="infopt-lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="check the installation: Python, torch, device, Triton, models")
    p.set_defaults(func=_cmd_doctor)

    from .hub import REMOTE
    p = sub.add_parser("fetch", help="download and convert the real model once, for offline use "
                                     "(checked by sha256, kept in a user cache)")
    p.add_argument("models", nargs="*", metavar="MODEL", default=sorted(REMOTE),
                   help=f"which model (default: all of {sorted(REMOTE)})")
    p.add_argument("--clear", action="store_true", help="remove the fetched models from the cache instead")
    p.set_defaults(func=_cmd_fetch)

    p = sub.add_parser("card", help="measure bundled models (val bits per byte, samples) and "
                                    "write their MODEL_CARD.md")
    p.add_argument("models", nargs="*", metavar="MODEL", default=["target", "draft"],
                   help="target and/or draft (default: both)")
    p.set_defaults(func=_cmd_card)

    from .bench import LADDER
    p = sub.add_parser("bench", help="measure the optimization ladder, side by side in one run")
    p.add_argument("--only", nargs="+", choices=list(LADDER), default=None,
                   help="run only these rungs")
    p.add_argument("--model", default=None,
                   help="'target' (default; smollm2-135m for --ladder), 'smollm2-135m' (the real model: decode, "
                        "precision and batch_size by default) or a model directory")
    from .bench import AGAINST
    p.add_argument("--against", choices=list(AGAINST), default=None,
                   help="with --only decode: decode beside llama.cpp on the real model's own GGUF file, interleaved "
                        "with our int4, int8, bf16 and fp32, eager and compiled (needs llama-cpp-python: "
                        "pip install 'infopt-lab[llama]'; without it, one line says how)")
    p.add_argument("--ladder", action="store_true",
                   help="the optimization ladder on the agentic workload: every rung, priced (about 15 minutes "
                        "on SmolLM2 on a 2-core CPU)")
    p.add_argument("--json", default=None, help="with --ladder: write the rungs to this JSON file (and a plot beside it)")
    p.add_argument("--price-per-hour", type=float, default=0.10,
                   help="with --ladder: what this machine costs per hour, for the cost per million tokens "
                        "(default 0.10, an example for a 2-vCPU cloud instance)")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("train", help="train a bundled model with the course's recipe (resumable)")
    p.add_argument("--preset", choices=sorted(RECIPES), required=True)
    p.add_argument("--out", required=True, help="output directory (rerun to resume)")
    p.add_argument("--tokenizer", default=None,
                   help="directory whose tokenizer.json to reuse (a draft shares its target's)")
    p.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    p.add_argument("--init", default=None, help="a model directory whose weights start the run "
                                                "(draft-distill starts from a trained draft)")
    p.set_defaults(func=_cmd_train)
    from .serving.cli import add_subcommands as add_serving_subcommands
    add_serving_subcommands(sub)
    from .grading.cli import add_subcommands as add_grading_subcommands
    add_grading_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; bad arguments end in one `error:` line and exit status 2, never a traceback."""
    from .hub import FetchError
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError, FetchError) as e:
        print(f"infopt-lab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
