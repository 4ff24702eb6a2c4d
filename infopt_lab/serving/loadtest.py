"""Load an OpenAI-compatible server from the client side and score it: vLLM's `bench serve` metrics, goodput.

Requests go out through the `openai` package's async client, streamed, at Poisson arrivals (`rate`,
requests or agent sessions per second) or with at most `concurrency` in flight, so the same command
measures this course's server, `vllm serve` or llama.cpp's `llama-server`. The definitions are vLLM's:

- TTFT: request sent -> first chunk with a choice; ITL: the gaps between such chunks;
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one token;
- E2E: request sent -> last chunk; output tokens from the usage chunk;
- throughput: completed requests, output tokens and all tokens per second of the run (first send -> last end);
- goodput: completed requests per second that met every SLO given (TTFT <= slo_ttft, TPOT <= slo_tpot).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field

from .. import validate
from ..metrics import percentiles
from ..workloads import agentic_workload, code_prompts, poisson_arrivals, skewed_lengths

WORKLOADS = ("skewed", "agentic")


@dataclass
class Turn:
    """One request to send: its text prompt and how many tokens to ask for."""

    prompt: str
    max_tokens: int


@dataclass
class Result:
    """What the client saw of one request (seconds from its send)."""

    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a one-token answer, as vLLM counts it)."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def build_jobs(workload: str, n: int, rate: float | None, seed: int = 0, new_tokens: int = 32):
    """(jobs, start times): each job a list of turns sent one after another (a session), or one request.

    skewed: n code prompts with mostly short and a few long answers (workloads.skewed_lengths);
    agentic: n agent sessions of 3 turns re-sending a 512-token system prompt (workloads.agentic_workload),
    each turn's prompt the conversation so far. Prompts are text, cut with the bundled tokenizer.
    """
    from ..loading import load_tokenizer_dir, resolve_model_dir
    validate.choice("workload", workload, WORKLOADS)
    tok = load_tokenizer_dir(resolve_model_dir("target"))
    if workload == "skewed":
        prompts = code_prompts(tok, n, seed=seed)
        jobs = [[Turn(p, m)] for p, m in zip(prompts, skewed_lengths(n, seed=seed))]
        return jobs, poisson_arrivals(n, rate, seed) if rate else [0.0] * n
    w = agentic_workload(tok, sessions=n, new_tokens=new_tokens, rate_per_s=rate or 1.0, seed=seed)
    system = tok.decode(list(w.system_ids), skip_special_tokens=True)
    jobs = [[Turn(tok.decode(list(u)), w.new_tokens) for u in s.user_ids] for s in w.sessions]
    for job in jobs:
        job[0].prompt = system + job[0].prompt
    return jobs, [s.start_s for s in w.sessions] if rate else [0.0] * n


async def send(client, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> Result:
    """Stream one completion and time its chunks."""
    start = time.perf_counter()
    r, last = Result(ok=True), start
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": ignore_eos} if ignore_eos else None)
        chunks = 0
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                if chunks == 0:
                    r.ttft_s = now - start
                else:
                    r.itl_s.append(now - last)
                chunks, last = chunks + 1, now
                r.text += chunk.choices[0].text or ""
            if chunk.usage is not None:
                r.prompt_tokens, r.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
        r.output_tokens = r.output_tokens or chunks
        r.e2e_s = last - start
        r.ok = chunks > 0
        r.error = "" if r.ok else "the stream ended without a token"
    except Exception as e:            # one failed request is a result, not the end of the run
        r.ok, r.error = False, f"{type(e).__name__}: {e}"
    return r


async def _run(url: str, model: str | None, jobs, starts, concurrency: int | None, ignore_eos: bool):
    """Send every job from its start time (or as slots free up); every result and the run's duration."""
    import httpx
    import openai
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    async with openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="EMPTY", max_retries=0, timeout=600.0,
                                  http_client=http) as client:
        if model is None:
            model = (await client.models.list()).data[0].id
        slots = asyncio.Semaphore(concurrency) if concurrency else None
        results: list[Result] = []

        async def session(job: list[Turn], delay: float) -> None:
            await asyncio.sleep(delay)
            history = ""
            for turn in job:
                prompt = history + turn.prompt
                if slots is None:
                    r = await send(client, model, prompt, turn.max_tokens, ignore_eos)
                else:
                    async with slots:
                        r = await send(client, model, prompt, turn.max_tokens, ignore_eos)
                results.append(r)
                if not r.ok:
                    return                            # a failed turn ends its session
                history = prompt + r.text

        start = time.perf_counter()
        await asyncio.gather(*(session(j, s) for j, s in zip(jobs, starts)))
        return model, results, time.perf_counter() - start


def summarize(results: list[Result], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """The run's metrics in vLLM's definitions: throughputs, TTFT / TPOT / ITL / E2E (ms: mean, p50, p90, p99), goodput."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean": None, "p50": None, "p90": None, "p99": None}
        return {"mean": 1e3 * sum(values) / len(values), **{k: 1e3 * v for k, v in percentiles(values).items()}}

    good = [r for r in done if (slo_ttft_ms is None or r.ttft_s * 1e3 <= slo_ttft_ms)
            and (slo_tpot_ms is None or r.tpot_s * 1e3 <= slo_tpot_ms)]
    slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    return {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration_s,
            "input_tokens": in_tokens, "output_tokens": out_tokens,
            "request_throughput": len(done) / duration_s, "output_throughput": out_tokens / duration_s,
            "total_token_throughput": (in_tokens + out_tokens) / duration_s,
            "ttft_ms": stats([r.ttft_s for r in done]),
            "tpot_ms": stats([r.tpot_s for r in done if r.output_tokens > 1]),
            "itl_ms": stats([x for r in done for x in r.itl_s]), "e2el_ms": stats([r.e2e_s for r in done]),
            "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
            "goodput": len(good) / duration_s if slo else None,
            "errors": sorted({r.error for r in results if not r.ok})[:5]}


def knee(offered: list[float], achieved: list[float], keep_up: float = 0.9) -> float:
    """The saturation knee: going up, the last offered rate the server keeps up with (achieved >= keep_up x offered).

    Rates after the first one it falls behind on do not count. Past the knee, requests arrive faster than they finish: throughput flattens and queues, TTFT with them, grow.
    ValueError when the server keeps up with none of the rates.
    """
    offered = validate.reals("offered", offered, low=0)
    achieved = validate.reals("achieved", achieved, low=0, length=len(offered))
    best = None
    for o, a in sorted(zip(offered, achieved)):
        if a < keep_up * o:
            break
        best = o
    if best is None:
        raise ValueError(f"the server kept up with none of the offered rates {offered} (at {keep_up:.0%} of each)")
    return best


def loadtest(url: str, rate: float | None = None, concurrency: int | None = None, workload: str = "skewed",
             num_requests: int = 64, model: str | None = None, slo_ttft_ms: float | None = None,
             slo_tpot_ms: float | None = None, ignore_eos: bool = True, seed: int = 0,
             new_tokens: int = 32) -> dict:
    """Load `url` (an OpenAI-compatible server) and return the run's metrics (`summarize`) and its settings.

    `num_requests` requests (skewed) or agent sessions (agentic) at Poisson `rate` per second, or at most
    `concurrency` requests in flight (both None: all at once). Works from a notebook too (its own loop).
    """
    if rate is not None and concurrency is not None:
        raise ValueError("give rate or concurrency, not both")
    rate = validate.real("rate", rate, low=0, low_open=True, allow_none=True)
    concurrency = validate.integer("concurrency", concurrency, low=1, allow_none=True)
    n = validate.integer("num_requests", num_requests, low=1)
    jobs, starts = build_jobs(workload, n, rate, seed, new_tokens)
    run = lambda: asyncio.run(_run(url, model, jobs, starts, concurrency, ignore_eos))   # noqa: E731
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        model, results, duration = run()
    else:                                           # inside Jupyter's loop: run ours in a thread
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            model, results, duration = pool.submit(run).result()
    settings = {"url": url, "model": model, "workload": workload, "num_requests": n, "rate": rate,
                "concurrency": concurrency, "ignore_eos": ignore_eos, "seed": seed}
    return {**settings, **summarize(results, duration, slo_ttft_ms, slo_tpot_ms)}


def report(m: dict) -> str:
    """The metrics as a table, in vLLM's `bench serve` layout."""
    load = f"rate {m['rate']}/s" if m["rate"] else f"concurrency {m['concurrency'] or 'unbounded'}"
    lines = [f"{m['workload']} workload, {load}, model {m['model']} at {m['url']}",
             f"{'completed / failed':<34}{m['completed']} / {m['failed']}",
             f"{'duration (s)':<34}{m['duration_s']:.2f}",
             f"{'request throughput (req/s)':<34}{m['request_throughput']:.2f}",
             f"{'output token throughput (tok/s)':<34}{m['output_throughput']:.1f}",
             f"{'total token throughput (tok/s)':<34}{m['total_token_throughput']:.1f}"]
    if m["goodput"] is not None:
        lines.append(f"{'goodput (req/s)':<34}{m['goodput']:.2f}  (SLO: TTFT <= {m['slo']['ttft_ms']} ms, "
                     f"TPOT <= {m['slo']['tpot_ms']} ms)")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
        s = m[key]
        if s["mean"] is not None:
            lines.append(f"{name + ' (ms) mean / p50 / p90 / p99':<34}{s['mean']:.1f} / {s['p50']:.1f} / "
                         f"{s['p90']:.1f} / {s['p99']:.1f}")
    return "\n".join(lines + [f"error: {e}" for e in m["errors"]])

