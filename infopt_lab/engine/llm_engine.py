"""The engine loop: add requests, schedule a step, run it, sample, retire; and `Engine.generate` around it."""
from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from torch import Tensor

from .. import validate
from ..device import synchronize
from ..feature_draft import FeatureDraft
from ..kv_cache import PagedKVCache
from ..kv_quant import QuantizedPagedKVCache
from ..metrics import request_metrics
from ..sampling import SamplingParams, check_request, make_generator, sample, sampling_params
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .scheduler import POLICIES, Batch
from .sequence import Sequence, Status
from .spec_decode import FeatureSpeculator, Speculator, check_speculation
from .stats import EngineStats, StepRecord


@dataclass
class RequestOutput:
    """One request's result: text, tokens, and its latency figures (metrics.py's definitions); `error` if refused."""

    request_id: int
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    ttft_s: float | None            # arrival -> first new token
    tpot_s: float | None            # mean gap between new tokens after the first
    e2e_s: float | None             # arrival -> last new token
    tokens_per_s: float | None      # new tokens / e2e_s
    token_times_s: list[float] = field(default_factory=list, repr=False)  # from arrival
    preemptions: int = 0
    error: str | None = None        # why the request was refused; None when it completed

    @property
    def ok(self) -> bool:
        """Whether the request was served."""
        return self.error is None


class Outputs(list):
    """`Engine.generate`'s result: one RequestOutput per prompt, in order, and the run's `stats`."""

    def __init__(self, outputs, stats: "EngineStats"):
        super().__init__(outputs)
        self.stats = stats


DEFAULT_MAX_MODEL_LEN = 2048   # an 8k-context model would reserve 8 x 8,192 positions per layer otherwise
KV_CACHE_DTYPES = {"auto": PagedKVCache, "int8": QuantizedPagedKVCache}   # "auto": the model's dtype (vLLM's name)


class LLMEngine:
    """Requests in, tokens out, one scheduled step at a time over a paged KV cache (vLLM's loop).

    `add_request(prompt, params)` queues a request, `step()` runs one step and returns the
    requests that finished in it, `has_unfinished()` says whether any is left; `generate`
    does all three for a list of prompts. `stats` covers everything since the clock was last reset.
    The KV pool holds `num_blocks` blocks; by default, room for `max_batch_size` requests of
    `max_model_len` tokens each (prompt + new tokens; the model's context, at most 2,048).
    `enable_prefix_caching=True` keeps the keys and values of every full block of computed tokens,
    keyed by its prefix, and lets later requests with the same prefix start after it.
    `draft` (a model sharing the tokenizer, or "ngram" for prompt lookup) with `num_speculative_tokens=k`
    drafts k tokens for every greedy decoding sequence and verifies them all in one packed target step.
    `kv_cache_dtype="int8"` stores keys and values as int8 with a scale per token and head (a quarter of
    fp32's bytes, plus the scales).
    `cascade_attention=True` reads the blocks that every decoding sequence of a step shares (a system prompt
    under prefix caching) once for all of them, then each sequence's own blocks, and merges the two softmaxes:
    the same attention up to float rounding, with far fewer keys copied per step.
    `paged_kernel` sends single decode tokens through the Triton paged kernel instead of gathering their keys:
    None (the default) where it compiles (CUDA), True wherever Triton runs (interpreted on a CPU), False never;
    per model, only where its head dim and block size are powers of two (the bundled draft's 24 is not), and
    `stats.decode_attention` says which path each model's decode steps took.
    `batch_invariant=True` computes every row of a step as if it were alone (invariant.py): a request's tokens
    are then bit-identical to `lab.generate(..., batch_invariant=True)` whatever else shares its steps.
    `compile=True` runs every step of single decode tokens through a compiled graph (compiled.py) at the
    smallest batch bucket (1, 2, 4, ... max_batch_size) that holds it, each sequence's block table padded to
    `max_model_len`: static shapes, compiled once per bucket; prefill, mixed and verify steps stay eager
    (vLLM captures CUDA graphs the same way), and `stats.decode_attention` counts the compiled steps.
    """

    def __init__(self, model, tok, scheduler: str = "continuous", max_batch_size: int = 8, block_size: int = 16,
                 num_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, enable_prefix_caching: bool = False, draft=None,
                 num_speculative_tokens: int = 0, kv_cache_dtype: str = "auto", cascade_attention: bool = False,
                 batch_invariant: bool = False, paged_kernel: bool | None = None, compile: bool = False):
        validate.model("model", model)
        validate.choice("scheduler", scheduler, POLICIES)
        validate.choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        self.model, self.tok, self.kv_cache_dtype = model, tok, kv_cache_dtype
        self.max_seq_len = model.config.max_seq_len
        self.max_batch_size = validate.integer("max_batch_size", max_batch_size, low=1)
        # the longest request (prompt + new tokens) a default pool holds for every slot at once
        self.max_model_len = validate.integer("max_model_len", max_model_len or min(self.max_seq_len,
                                              DEFAULT_MAX_MODEL_LEN), low=1, high=self.max_seq_len)
        budget = validate.integer("max_num_batched_tokens", max_num_batched_tokens or max(256, max_batch_size),
                                  low=max_batch_size)
        k = check_speculation(model, draft, num_speculative_tokens, self.max_model_len)
        pool = KV_CACHE_DTYPES[kv_cache_dtype]
        # the pool owns num_blocks and block_size (checked there, and against free memory before allocating);
        # by default it holds a full batch of the longest requests, so preemption is never needed
        self.cache = pool.for_model(model, num_blocks, block_size, reserve=(self.max_batch_size, self.max_model_len))
        self.blocks = BlockManager.for_pool(self.cache, enable_prefix_caching)
        self.scheduler = POLICIES[scheduler](self.blocks, self.max_batch_size, budget, k)
        cascade = validate.boolean("cascade_attention", cascade_attention)
        if validate.boolean("batch_invariant", batch_invariant) and cascade:
            raise ValueError("cascade_attention=True attends a shared prefix for many sequences in one product; "
                             "batch_invariant=True computes each sequence alone: choose one")
        if paged_kernel is not None:
            validate.boolean("paged_kernel", paged_kernel)
        compile_shape = (self.max_batch_size, -(-self.max_model_len // self.cache.block_size)) \
            if validate.boolean("compile", compile) else None
        self.runner = ModelRunner(model, self.cache, self.blocks, paged_kernel=paged_kernel, cascade=cascade,
                                  batch_invariant=batch_invariant, compile_shape=compile_shape)
        speculator = FeatureSpeculator if isinstance(draft, FeatureDraft) else Speculator
        self.speculator = speculator(self.runner, draft, k, self.blocks, pool) if k else None
        self.device = self.runner.device
        self.sequences: dict[int, Sequence] = {}    # every request added since the clock was reset
        self.refused: list[Sequence] = []          # refused since the last step, reported by the next
        self.next_id, self.aborting = 0, []        # the next request's id; ids to drop at the next step
        self.step_tokens: dict[int, list[int]] = {}   # request id -> tokens it gained in the last step (streaming)
        self.reset_clock()

    def reset_clock(self) -> None:
        """Start a new run: the clock (arrival times count from here) and fresh stats."""
        synchronize(self.device)
        self.start = time.perf_counter()
        self.stats = EngineStats(max_batch_size=self.max_batch_size, block_size=self.blocks.block_size,
                                 max_seq_len=self.max_seq_len, kv_blocks_total=self.blocks.capacity)
        self.preempted_before = self.scheduler.preemptions
        for runner in self._runners().values():
            runner.decode_steps.clear()

    def now(self) -> float:
        """Seconds since the clock was reset."""
        return time.perf_counter() - self.start

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_s: float | None = None) -> int:
        """Queue one request (text, or token ids); its id. One that can never be served is refused by the next step."""
        params = sampling_params(params)
        arrival = self.now() if arrival_s is None else validate.arrival_time("arrival_s", arrival_s)
        seq_id, self.next_id = self.next_id, self.next_id + 1
        seq = Sequence(seq_id, self._ids(prompt), params, arrival, params.stop_ids(self.tok.eos_token_id),
                       make_generator(params.seed, self.device))
        self.sequences[seq_id] = seq
        self.stats.requests += 1
        seq.error = self.why_unservable(seq)
        if seq.error:
            seq.status = Status.FAILED
            self.refused.append(seq)
        else:
            self.scheduler.add(seq)
        return seq_id

    def abort_all(self) -> None:
        """Drop every request, queued, running or refused, and free the KV blocks they held."""
        self.scheduler.clear()
        self.sequences, self.refused, self.aborting, self.next_id = {}, [], [], 0

    def abort_request(self, request_id: int) -> None:
        """Drop one request (a client hung up): at the next step it leaves the queue or the batch, its blocks freed."""
        self.aborting.append(request_id)

    def release(self, request_id: int) -> None:
        """Forget a finished request's state (a server keeps no history); an unfinished one is refused."""
        seq = self.sequences.get(request_id)
        if seq is not None and not seq.done:
            raise ValueError(f"request {request_id} has not finished; abort_request it instead")
        self.sequences.pop(request_id, None)

    def has_unfinished(self) -> bool:
        """Whether a request is queued, running, or refused but not yet reported."""
        return self.scheduler.has_work or bool(self.refused)

    def wait_for_arrival(self) -> None:
        """Nothing can run until the next request arrives: move the clock to it (idle time passes, never slept)."""
        nxt = self.scheduler.next_arrival()
        if nxt is None:
            raise RuntimeError("the scheduler has queued work but can run none of it")
        self.start -= max(0.0, nxt - self.now())

    def why_unservable(self, seq: Sequence) -> str | None:
        """Why a request can never be served (None when it can): the request check, then the KV pool's size."""
        try:
            check_request(seq.prompt_ids, seq.params, self.model.config)
        except ValueError as e:
            return str(e)
        need = self.blocks.blocks_for(seq.max_length)
        if need > self.blocks.capacity:
            return (f"it needs {need} KV blocks of {self.blocks.block_size} tokens but the pool has "
                    f"{self.blocks.capacity}; raise num_blocks or shorten the request")
        return None

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; the outputs of the requests that finished in it (refused ones included)."""
        finished, self.refused = self.refused, []
        self._apply_aborts()
        batch = self.scheduler.schedule(self.now())
        before = [(c.seq, len(c.seq.output_ids)) for c in batch.chunks]
        if not batch.empty:
            finished += self._run(batch)
        self.step_tokens = {s.seq_id: s.output_ids[n:] for s, n in before if len(s.output_ids) > n}
        self.stats.wall_s = self.now()
        for seq in finished:
            self._count(seq)
        return [self.output(s) for s in finished]

    def _apply_aborts(self) -> None:
        """Drop the requests aborted since the last step: the scheduler frees their blocks, the engine forgets them."""
        for request_id in self.aborting:
            seq = self.sequences.pop(request_id, None)
            if seq is not None and not seq.done:
                self.scheduler.abort(seq)
            if seq in self.refused:
                self.refused.remove(seq)
        self.aborting = []

    def _run(self, batch: Batch) -> list[Sequence]:
        """Run a scheduled batch (the model runner, or the speculator), let the scheduler apply it; who finished."""
        start, rows = self.now(), self._rows(batch)
        executor = self.runner if self.speculator is None else self.speculator
        outputs = executor.execute_model(batch, self._sample)
        synchronize(self.device)
        t = self.now()
        finished = self.scheduler.update_from_output(batch, outputs, t)
        running = self.scheduler.running
        self.stats.timeline.append(StepRecord(start, t, rows, sum(s.num_computed for s in running),
                                              self.blocks.num_used, len(running)))
        self.stats.steps += 1
        self.stats.sampled_rows += sum(1 for o in outputs.values() if o.tokens)
        self.stats.padding_rows += len(batch.padding)
        self.stats.kv_blocks_peak = max(self.stats.kv_blocks_peak, self.blocks.num_used)
        self.stats.preemptions = self.scheduler.preemptions - self.preempted_before
        self.stats.decode_attention = self._decode_attention()
        return finished

    def _runners(self) -> dict[str, ModelRunner]:
        """The model runners by role: the target's, and the draft model's when it speculates with one."""
        runners = {"target": self.runner}
        if self.speculator is not None and self.speculator.draft is not None:
            runners["draft"] = self.speculator.draft
        return runners

    def _decode_attention(self) -> dict[str, dict[str, int]]:
        """Per model, how many steps its decode tokens attended by each path since the clock was reset."""
        return {name: dict(r.decode_steps) for name, r in self._runners().items()}

    @staticmethod
    def _sample(logits: Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row with each request's own settings and generator; all-greedy rows in one argmax."""
        if not seqs:
            return []
        if all(s.params.greedy for s in seqs):
            return sample(logits, seqs[0].params).tolist()
        return [int(sample(row, s.params, s.generator)) for row, s in zip(logits, seqs)]

    def _count(self, seq: Sequence) -> None:
        """Add a finished or refused request to the stats."""
        self.stats.completed += seq.status is Status.FINISHED
        self.stats.failed += seq.status is Status.FAILED
        self.stats.generated_tokens += len(seq.output_ids)
        self.stats.recomputed_tokens += seq.recomputed_tokens
        self.stats.prefix_lookup_tokens += seq.looked_up_tokens
        self.stats.prefix_hit_tokens += seq.cached_tokens
        self.stats.draft_tokens += seq.draft_tokens
        self.stats.accepted_tokens += seq.accepted_tokens
        self.stats.judged_tokens += seq.judged_tokens
        self.stats.spec_rounds += seq.spec_rounds

    def output(self, seq: Sequence) -> RequestOutput:
        """A request's RequestOutput, its latency figures measured from its arrival."""
        m = request_metrics(seq.arrival_s, seq.token_times_s) if seq.token_times_s else None
        return RequestOutput(seq.seq_id, self.tok.decode(seq.output_ids, skip_special_tokens=True),
                             list(seq.output_ids), list(seq.prompt_ids),
                             m and m.ttft_s, m and m.tpot_s, m and m.e2e_s, m and m.tokens_per_s,
                             [x - seq.arrival_s for x in seq.token_times_s], seq.preemptions, seq.error)

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tok.encode(prompt) if prompt else []       # encode adds the BOS token
        if isinstance(prompt, Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return [int(t) for t in prompt]

    @staticmethod
    def _rows(batch: Batch) -> list[tuple[int, int, str]]:
        rows = [(c.seq.slot, c.seq.seq_id, "decode" if c.num_tokens == 1 else "prefill") for c in batch.chunks]
        return rows + [(s.slot, s.seq_id, "padding") for s in batch.padding]


    def serve(self, add_requests: Callable[[], None],
              on_finished: Callable[[RequestOutput], None] | None = None, total: int | None = None,
              progress: bool = False) -> None:
        """The one driving loop: from a new engine, add the first requests, then step until nothing is left.

        `on_finished` sees every request as it finishes and may add more (the next turn of a session).
        When nothing can run, the clock moves to the next arrival (idle time passes, never slept). The
        engine must hold no unfinished request first; on any error it is left as new (nothing queued,
        no blocks held). `total` requests in the progress bar (`progress=True`).
        """
        if self.has_unfinished():
            raise ValueError(f"the engine holds {len(self.sequences)} request(s) added with add_request that have "
                             "not finished; step() until has_unfinished() is False, or call abort_all(), first")
        self.abort_all()
        self.reset_clock()
        bar = progress_bar(total, progress)
        try:
            add_requests()
            self.start = time.perf_counter()        # the clock starts once the first requests are in (tokenized)
            while self.has_unfinished():
                done = self.step()
                for out in done:
                    if on_finished is not None:
                        on_finished(out)
                if bar is not None:
                    bar.update(len(done))
                if not done and self.scheduler.has_work and not self.scheduler.running:
                    self.wait_for_arrival()
        except BaseException:
            self.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()


class Engine(LLMEngine):
    """`lab.Engine(model, tok, scheduler="continuous").generate(prompts, lab.SamplingParams(max_new_tokens=64))`."""

    def generate(self, prompts: Seq[str] | Seq[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 arrival_s: Seq[float] | None = None, progress: bool = False, **overrides) -> Outputs:
        """Serve every prompt; one output per prompt, in order, with the run's `stats`. Refused requests carry `error`.

        `params` is one SamplingParams for all, or one per prompt; keyword overrides (SamplingParams
        fields) apply to all, and `max_new_tokens` may be a list with one length per prompt.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings (or of token-id lists), not one string")
        prompts = list(prompts)
        per_request = self._per_request(len(prompts), params, arrival_s, overrides)
        ids: list[int] = []
        self.serve(lambda: ids.extend(self.add_request(p, ps, a) for p, (ps, a) in zip(prompts, per_request)),
                   total=len(prompts), progress=progress)
        return Outputs([self.output(self.sequences[i]) for i in ids], self.stats)

    def _per_request(self, n: int, params, arrival_s, overrides: dict) -> list[tuple[SamplingParams, float]]:
        """(params, arrival) for each of n prompts, every list checked to hold one entry per prompt."""
        lengths = overrides.pop("max_new_tokens", None)
        if isinstance(params, SamplingParams) or params is None:
            params = [params] * n
        params = list(params)
        if isinstance(lengths, Seq):
            lengths = list(lengths)
        else:
            lengths = [lengths] * n
        arrivals = [0.0] * n if arrival_s is None else validate.arrival_times("arrival_s", arrival_s)
        if not len(params) == len(lengths) == len(arrivals) == n:
            raise ValueError(f"got {n} prompts, {len(params)} params, {len(lengths)} max_new_tokens and "
                             f"{len(arrivals)} arrival times; give one per prompt")
        extra = [{} if m is None else {"max_new_tokens": m} for m in lengths]
        return [(sampling_params(p, **overrides, **e), a) for p, e, a in zip(params, extra, arrivals)]



def progress_bar(total: int | None, show: bool):
    """A tqdm bar over `total` requests when `show`, else None."""
    if not show:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="requests", unit="req")
