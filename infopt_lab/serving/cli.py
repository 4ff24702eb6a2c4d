"""`infopt-lab serve` and `infopt-lab loadtest`, registered on the main parser by `add_subcommands`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cmd_serve(args) -> int:
    import infopt_lab as lab
    from ..engine.llm_engine import Engine
    from .app import serve
    model, tok = lab.load_model(args.model)
    draft = None
    if args.draft is not None:
        draft = "ngram" if args.draft == "ngram" else lab.load_model(args.draft)[0]
    engine = Engine(model, tok, scheduler=args.scheduler, max_batch_size=args.max_batch_size,
                    num_blocks=args.num_blocks, enable_prefix_caching=args.enable_prefix_caching,
                    kv_cache_dtype=args.kv_cache_dtype, draft=draft,
                    num_speculative_tokens=args.num_speculative_tokens if draft is not None else 0)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1 ({args.scheduler} batching, "
          f"max batch {args.max_batch_size}, prefix caching {'on' if args.enable_prefix_caching else 'off'})")
    serve(engine, Path(args.model).name if Path(args.model).is_dir() else args.model, args.host, args.port,
          args.max_waiting)
    return 0


def _cmd_loadtest(args) -> int:
    from .loadtest import loadtest, report
    m = loadtest(args.url, rate=args.rate, concurrency=args.concurrency, workload=args.workload,
                 num_requests=args.num_requests, model=args.model, slo_ttft_ms=args.slo_ttft_ms,
                 slo_tpot_ms=args.slo_tpot_ms, ignore_eos=not args.no_ignore_eos, seed=args.seed)
    print(report(m))
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0 if m["completed"] else 1


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register `serve` and `loadtest` on the `infopt-lab` subcommand parser."""
    from .loadtest import WORKLOADS
    p = sub.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP endpoint "
                                     "(/v1/completions, /v1/chat/completions, /metrics)")
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' (default), 'target', or a model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--scheduler", choices=["continuous", "static"], default="continuous")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: a full batch of "
                                                                  "the longest requests)")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto")
    p.add_argument("--draft", default=None, help="a draft model name or directory, or 'ngram' (prompt lookup), "
                                                 "for speculative decoding of greedy requests")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond which new ones get 429 with Retry-After (default 256)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("loadtest", help="load an OpenAI-compatible server (ours, vllm serve, llama-server) and "
                                        "report TTFT, TPOT, ITL, E2E, throughput and goodput (vLLM's definitions)")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals: requests (agentic: sessions) per s")
    load.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--workload", choices=WORKLOADS, default="skewed")
    p.add_argument("--num-requests", type=int, default=64, help="requests (agentic: sessions of 3 turns)")
    p.add_argument("--model", default=None, help="model name to ask for (default: the server's first)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput counts requests with TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="... and TPOT at most this")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: generate "
                                                                "every asked token, as vLLM's bench --ignore-eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the metrics to this JSON file")
    p.set_defaults(func=_cmd_loadtest)
