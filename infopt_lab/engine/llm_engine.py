"""The engine loop: schedule a step, run it, sample, retire; and `Engine.generate` around it."""
from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from ..device import synchronize
from ..kv_cache import PagedKVCache
from ..sampling import logits_to_probs
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .scheduler import POLICIES, Batch, Scheduler
from .sequence import Sequence, Status


@dataclass
class RequestOutput:
    request_id: int
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    ttft_s: float | None            # arrival -> first new token
    latency_s: float | None         # arrival -> last new token
    preemptions: int = 0
    error: str | None = None        # why the request was refused; None when it completed

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class StepRecord:
    start_s: float
    end_s: float
    rows: list[tuple[int, int, str]]    # (slot, request id, "prefill" | "decode" | "padding")
    kv_tokens: int                      # tokens whose keys and values the pool holds after the step
    kv_blocks: int                      # blocks in use after the step
    running: int                        # sequences holding blocks


@dataclass
class EngineStats:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0
    sampled_rows: int = 0           # rows that produced a token
    padding_rows: int = 0           # rows computed for finished members of a static batch
    preemptions: int = 0
    recomputed_tokens: int = 0
    max_batch_size: int = 1
    block_size: int = 16
    max_seq_len: int = 0
    kv_blocks_total: int = 0
    kv_blocks_peak: int = 0
    eos_id: int | None = field(default=None, repr=False)
    start: float = field(default=0.0, repr=False)          # perf_counter at the run's start
    timeline: list[StepRecord] = field(default_factory=list, repr=False)

    @property
    def throughput_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def utilization(self) -> float:
        """Share of the rows a batch held that produced a token (the seed's useful / total time)."""
        held = self.sampled_rows + self.padding_rows
        return self.sampled_rows / held if held else float("nan")

    @property
    def occupancy(self) -> float:
        """Mean rows producing a token per step, as a share of max_batch_size."""
        return self.sampled_rows / (self.steps * self.max_batch_size) if self.steps else float("nan")

    @property
    def kv_real_share(self) -> float:
        """Share of allocated paged-KV slots holding a real token, over all steps."""
        alloc = sum(r.kv_blocks for r in self.timeline) * self.block_size
        return sum(r.kv_tokens for r in self.timeline) / alloc if alloc else float("nan")

    @property
    def kv_real_share_contiguous(self) -> float:
        """The same share had each running sequence preallocated the model's whole context."""
        alloc = sum(r.running for r in self.timeline) * self.max_seq_len
        return sum(r.kv_tokens for r in self.timeline) / alloc if alloc else float("nan")

    def summary(self) -> str:
        return (f"{self.generated_tokens} tokens in {self.wall_s:.2f} s = {self.throughput_tok_s:.1f} tok/s, "
                f"{self.steps} steps, utilization {self.utilization:.1%}, occupancy {self.occupancy:.1%}, "
                f"preemptions {self.preemptions}, KV blocks peak {self.kv_blocks_peak}/{self.kv_blocks_total}")


class LLMEngine:
    """Requests in, tokens out, one scheduled step at a time over a paged KV cache."""

    def __init__(self, model, tok, scheduler: str = "continuous", max_batch_size: int = 8, block_size: int = 16,
                 num_blocks: int | None = None, max_num_batched_tokens: int | None = None):
        if scheduler not in POLICIES:
            raise ValueError(f"scheduler must be one of {POLICIES}, got {scheduler!r}")
        for name, value in [("max_batch_size", max_batch_size), ("block_size", block_size)]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.model, self.tok = model, tok
        self.max_seq_len = model.config.max_seq_len
        if num_blocks is None:    # room for a full batch at full context: preemption never needed
            num_blocks = max_batch_size * -(-self.max_seq_len // block_size) + 1
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is reserved), got {num_blocks!r}")
        budget = max_num_batched_tokens or max(256, max_batch_size)
        if budget < max_batch_size:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_batch_size ({max_batch_size})")
        self.max_batch_size = max_batch_size
        self.blocks = BlockManager(num_blocks, block_size)
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.scheduler = Scheduler(scheduler, self.blocks, max_batch_size, budget)
        self.runner = ModelRunner(model, self.cache, self.blocks)
        self.device = self.runner.device

    def fits(self, seq: Sequence) -> str | None:
        """Why a request can never be served (None when it can)."""
        if not seq.prompt_ids:
            return "the prompt is empty: give at least one token"
        vocab = self.model.config.vocab_size
        bad = [t for t in seq.prompt_ids if not 0 <= t < vocab]
        if bad:
            return f"token ids must be in [0, {vocab}), got {bad[:5]}"
        if not isinstance(seq.max_new_tokens, int) or seq.max_new_tokens < 1:
            return f"max_new_tokens must be a positive integer, got {seq.max_new_tokens!r}"
        total = len(seq.prompt_ids) + seq.max_new_tokens
        if total > self.max_seq_len:
            return (f"prompt of {len(seq.prompt_ids)} tokens + max_new_tokens={seq.max_new_tokens} exceeds "
                    f"the model's context of {self.max_seq_len} tokens")
        need = self.blocks.blocks_for(seq.max_length)
        if need > self.blocks.capacity:
            return (f"it needs {need} KV blocks of {self.blocks.block_size} tokens but the pool has "
                    f"{self.blocks.capacity}; raise num_blocks or shorten the request")
        return None

    def step(self, now: float, stats: EngineStats, sample_fn) -> list[Sequence] | None:
        """Schedule and run one step; the sequences that finished in it, None when nothing could run."""
        batch = self.scheduler.schedule(now)
        if batch.empty:
            return None
        rows = self._rows(batch)
        logits = self.runner.run(batch)                     # (R, V): one row per chunk that samples
        sampling = [c.seq for c in batch.chunks if c.samples]
        for chunk in batch.chunks:
            chunk.seq.num_computed += chunk.num_tokens
        tokens = sample_fn(logits, sampling).tolist() if sampling else []
        synchronize(self.device)
        t = time.perf_counter() - stats.start
        finished = []
        for seq, token in zip(sampling, tokens):
            seq.output_ids.append(token)
            if seq.first_token_s is None:
                seq.first_token_s = t
            if len(seq.output_ids) >= seq.max_new_tokens or token == stats.eos_id:
                seq.finish_s = t
                self.scheduler.retire(seq)
                finished.append(seq)
        running = self.scheduler.running
        stats.timeline.append(StepRecord(now, t, rows, sum(s.num_computed for s in running),
                                         self.blocks.num_used, len(running)))
        stats.steps += 1
        stats.sampled_rows += len(sampling)
        stats.padding_rows += len(batch.padding)
        stats.kv_blocks_peak = max(stats.kv_blocks_peak, self.blocks.num_used)
        return finished

    @staticmethod
    def _rows(batch: Batch) -> list[tuple[int, int, str]]:
        rows = [(c.seq.slot, c.seq.seq_id, "decode" if c.num_tokens == 1 else "prefill") for c in batch.chunks]
        return rows + [(s.slot, s.seq_id, "padding") for s in batch.padding]


class Engine(LLMEngine):
    """`lab.Engine(model, tok, scheduler="continuous").generate(prompts, max_new_tokens=64)`."""

    def generate(self, prompts: Seq[str] | Seq[list[int]], max_new_tokens: int | Seq[int] = 64,
                 temperature: float = 0.0, arrival_s: Seq[float] | None = None, seed: int = 0,
                 stop_at_eos: bool = True, progress: bool = False) -> list[RequestOutput]:
        """Serve every prompt; one output per prompt, in order. Refused requests carry `error`."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings (or of token-id lists), not one string")
        prompts = list(prompts)
        n = len(prompts)
        news = list(max_new_tokens) if isinstance(max_new_tokens, Seq) else [max_new_tokens] * n
        arrivals = [0.0] * n if arrival_s is None else [float(a) for a in arrival_s]
        if len(news) != n or len(arrivals) != n:
            raise ValueError(f"got {n} prompts, {len(news)} max_new_tokens and {len(arrivals)} arrival times; "
                             "give one per prompt")
        if temperature is None or temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        seqs = [Sequence(i, self._ids(p), m, a) for i, (p, m, a) in enumerate(zip(prompts, news, arrivals))]
        self.stats = self._serve(seqs, temperature, seed, stop_at_eos, progress)
        return [self._output(s) for s in seqs]

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tok.encode(prompt) if prompt else []       # encode adds the BOS token
        return [int(t) for t in prompt]

    def _serve(self, seqs: list[Sequence], temperature: float, seed: int, stop_at_eos: bool,
               progress: bool) -> EngineStats:
        stats = EngineStats(requests=len(seqs), max_batch_size=self.max_batch_size,
                            block_size=self.blocks.block_size, max_seq_len=self.max_seq_len,
                            kv_blocks_total=self.blocks.capacity)
        stats.eos_id = self.tok.eos_token_id if stop_at_eos else None
        for seq in sorted(seqs, key=lambda s: s.arrival_s):
            seq.error = self.fits(seq)
            if seq.error:
                seq.status = Status.FAILED
            else:
                self.scheduler.add(seq)
        sample_fn = _sampler(temperature, seed, self.device)
        preempted_before = self.scheduler.preemptions
        bar = _progress(sum(not s.error for s in seqs), progress)
        synchronize(self.device)
        stats.start = time.perf_counter()
        while self.scheduler.has_work:
            now = time.perf_counter() - stats.start
            finished = self.step(now, stats, sample_fn)
            if finished is not None:
                if bar is not None:
                    bar.update(len(finished))
            else:                                              # nothing runnable: wait for the next arrival
                nxt = self.scheduler.next_arrival()
                if nxt is None:
                    raise RuntimeError("the scheduler has queued work but can run none of it")
                time.sleep(max(0.0, nxt - (time.perf_counter() - stats.start)))
        stats.wall_s = time.perf_counter() - stats.start
        if bar is not None:
            bar.close()
        stats.completed = sum(s.status is Status.FINISHED for s in seqs)
        stats.failed = sum(s.status is Status.FAILED for s in seqs)
        stats.generated_tokens = sum(len(s.output_ids) for s in seqs)
        stats.preemptions = self.scheduler.preemptions - preempted_before
        stats.recomputed_tokens = sum(s.recomputed_tokens for s in seqs)
        return stats

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.seq_id, self.tok.decode(seq.output_ids, skip_special_tokens=True),
                             list(seq.output_ids), list(seq.prompt_ids), seq.ttft_s, seq.latency_s,
                             seq.preemptions, seq.error)


def _sampler(temperature: float, seed: int, device):
    """Greedy argmax, or a draw with one seeded generator per request (so batching cannot change it)."""
    if temperature == 0:
        return lambda logits, seqs: logits.argmax(-1)
    generators: dict[int, torch.Generator] = {}

    def sample(logits, seqs):
        probs = logits_to_probs(logits, temperature)
        out = []
        for row, seq in zip(probs, seqs):
            g = generators.setdefault(seq.seq_id, torch.Generator(device=device).manual_seed(seed + seq.seq_id))
            out.append(torch.multinomial(row, 1, generator=g))
        return torch.cat(out)
    return sample


def _progress(total: int, show: bool):
    if not show:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="requests", unit="req")
