"""Which sequences run in the next step, and with how many tokens.

Both policies feed running sequences first (one token each while decoding, a
chunk while prefilling), then admit waiting ones within a slot limit
(max_batch_size) and a token budget per step (max_num_batched_tokens); a long
prompt is prefilled in chunks across steps. When the block pool runs out, the
newest running sequence is preempted: its blocks are freed and it is queued
again, to be recomputed later. With prefix caching, a sequence admitted with
cached blocks starts after them: only the rest of its prompt is computed.

The scheduler is the one writer of per-step state (vLLM's `update_from_output`):
the model runner and the speculator return what a step produced as data, and
`update_from_output` advances each sequence's computed tokens, appends its new
tokens, decides whether it finished (length, EOS, stop ids: `finish_tokens`),
and commits, truncates or frees its blocks.

- continuous: admits and retires at every step, so a finished request's slot
  is refilled at once.
- static: forms a fixed batch and admits nothing until all of it has finished;
  a finished member keeps its row as padding, computed and thrown away, like a
  padded batched `generate`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..generate import finish_tokens
from .block_manager import BlockManager
from .sequence import Chunk, SeqOutput, Sequence, Status


@dataclass
class Batch:
    """One step's work: a chunk per scheduled sequence, and the finished rows a static batch still computes."""

    chunks: list[Chunk] = field(default_factory=list)
    padding: list[Sequence] = field(default_factory=list)   # finished rows a static batch still carries

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Feeds running sequences, admits waiting ones, preempts under KV pressure; a policy subclass says when."""

    name = ""

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_batched_tokens: int,
                 num_speculative_tokens: int = 0):
        self.blocks = blocks
        self.max_batch_size, self.max_num_batched_tokens = max_batch_size, max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens   # draft slots a greedy decoding sequence may fill
        self.waiting: deque[Sequence] = deque()    # first come, first served
        self.running: list[Sequence] = []          # in admission order: the newest is preempted first
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request behind every queued one that arrives no later (first come, first served)."""
        at = next((i for i, s in enumerate(self.waiting) if s.arrival_s > seq.arrival_s), len(self.waiting))
        self.waiting.insert(at, seq)

    def clear(self) -> None:
        """Drop every queued and running request and free its blocks: the state of a new scheduler."""
        for seq in self.running:
            self.blocks.free(seq.seq_id)
        self.waiting.clear()
        self.running.clear()

    def abort(self, seq: Sequence) -> None:
        """Drop one request, queued or running (its client gave up): its blocks are freed, it never finishes."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.blocks.free(seq.seq_id)
            self.running.remove(seq)
        seq.status, seq.slot, seq.error = Status.FAILED, None, "aborted"

    @property
    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        """When the next queued request arrives (None when nothing is queued)."""
        return min((s.arrival_s for s in self.waiting), default=None)

    def schedule(self, now: float) -> Batch:
        """The chunks to compute in the next step."""
        batch, budget = Batch(), self.max_num_batched_tokens
        for seq in list(self.running):                       # oldest first
            if seq.status is not Status.RUNNING:             # preempted for an older one just now
                continue
            n = min(seq.num_uncomputed, budget)
            if n == 0:
                break
            extra = min(self.lookahead(seq), budget - n) if n == seq.num_uncomputed == 1 else 0
            if self._make_room(seq, n + extra, batch):
                self.blocks.append(seq.seq_id, n + extra)
                batch.chunks.append(Chunk.of(seq, n, extra))
                budget -= n + extra
        for seq in self._candidates(now):
            hit = self.blocks.match(seq.all_ids)                 # cached blocks of its prefix (prefix caching)
            cached = len(hit) * self.blocks.block_size
            n = min(seq.length - cached, budget)
            if n == 0 or len(self.running) >= self.max_batch_size or not self.blocks.can_allocate(hit, cached + n):
                break
            self._admit(seq)
            self.blocks.allocate(seq.seq_id, cached + n, hit)
            seq.num_computed = seq.draft_computed = cached
            seq.looked_up_tokens += seq.length if self.blocks.enable_prefix_caching else 0
            seq.cached_tokens += cached
            batch.chunks.append(Chunk.of(seq, n))
            budget -= n
        return batch

    def lookahead(self, seq: Sequence) -> int:
        """Draft slots a decoding sequence may fill this step: k, fewer near its end, 0 if it samples."""
        if not self.num_speculative_tokens or not seq.params.greedy:
            return 0
        return max(0, min(self.num_speculative_tokens, seq.max_new_tokens - len(seq.output_ids) - 1))

    def update_from_output(self, batch: Batch, outputs: dict[Sequence, SeqOutput], now: float) -> list[Sequence]:
        """Apply what a step produced (vLLM's name): the only place sequences advance; the ones that finished.

        Every chunk's sequence counts its kept keys and values as computed, takes its new tokens up to
        where it finishes (`finish_tokens`), caches its full computed blocks (prefix caching), and either
        retires or gives back the slots of rejected drafts.
        """
        finished = []
        for chunk in batch.chunks:
            seq, out = chunk.seq, outputs[chunk.seq]
            seq.num_computed += out.computed
            seq.draft_computed = seq.num_computed if out.draft_computed is None else \
                min(seq.num_computed, out.draft_computed)
            self._count_drafts(seq, out)
            tokens, done = finish_tokens(out.tokens, len(seq.output_ids), seq.max_new_tokens, seq.stop_ids)
            seq.output_ids += tokens
            seq.token_times_s += [now] * len(tokens)
            self.blocks.commit(seq.seq_id, seq.all_ids[:min(seq.num_computed, seq.draft_computed)])
            if done:
                self.retire(seq)
                finished.append(seq)
            elif chunk.lookahead:
                self.blocks.truncate(seq.seq_id, seq.num_computed)         # roll back the rejected drafts
        return finished

    @staticmethod
    def _count_drafts(seq: Sequence, out: SeqOutput) -> None:
        if out.drafted:
            seq.draft_tokens += out.drafted
            seq.accepted_tokens += out.accepted
            seq.judged_tokens += out.accepted + (out.accepted < out.drafted)   # after a rejection nothing is judged
            seq.spec_rounds += 1

    def retire(self, seq: Sequence) -> None:
        """A sequence finished: free its blocks."""
        seq.status = Status.FINISHED
        self.blocks.free(seq.seq_id)
        self.running.remove(seq)

    # -- what the policies decide ------------------------------------------------------
    def _candidates(self, now: float) -> list[Sequence]:
        """Sequences that may be admitted now, in order."""
        raise NotImplementedError

    def _admit(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _make_room(self, seq: Sequence, n: int, batch: Batch) -> bool:
        """Preempt the newest running sequences until `seq` can take n more tokens; False if it was one."""
        scheduled = {c.seq for c in batch.chunks}
        while not self.blocks.can_append(seq.seq_id, n):
            victim = next(s for s in reversed(self.running) if s not in scheduled)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; its cache is recomputed when it runs again."""
        self.blocks.free(seq.seq_id)
        self.running.remove(seq)
        seq.recomputed_tokens += seq.num_computed
        seq.num_computed = seq.draft_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1


class ContinuousScheduler(Scheduler):
    """Admits and retires at every step, so a finished request's slot is refilled at once."""

    name = "continuous"

    def retire(self, seq: Sequence) -> None:
        """Free its blocks and its slot."""
        super().retire(seq)
        seq.slot = None

    def _candidates(self, now: float) -> list[Sequence]:
        """Queued requests that have arrived, first come first served."""
        ready = []
        for seq in self.waiting:
            if seq.arrival_s > now:
                break
            ready.append(seq)
        return ready

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        taken = {s.slot for s in self.running}
        seq.slot = next(i for i in range(self.max_batch_size) if i not in taken)
        super()._admit(seq)

    def _preempt(self, seq: Sequence) -> None:
        super()._preempt(seq)
        seq.slot = None
        self.waiting.appendleft(seq)


class StaticScheduler(Scheduler):
    """Forms a fixed batch and admits nothing until all of it has finished; finished rows ride along as padding."""

    name = "static"

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_batched_tokens: int,
                 num_speculative_tokens: int = 0):
        super().__init__(blocks, max_batch_size, max_num_batched_tokens, num_speculative_tokens)
        self.members: list[Sequence] = []          # the current fixed batch

    @property
    def has_work(self) -> bool:
        """Whether any request is queued, running, or a member of the batch still to finish."""
        return super().has_work or any(not s.done for s in self.members)

    def clear(self) -> None:
        """Drop the batch too."""
        super().clear()
        self.members = []

    def schedule(self, now: float) -> Batch:
        """Form a new batch when the last one is done; finished members are computed and thrown away."""
        if all(s.done for s in self.members):
            self._form_batch(now)
        batch = super().schedule(now)
        batch.padding = [s for s in self.members if s.status is Status.FINISHED]
        return batch

    def _form_batch(self, now: float) -> None:
        self.members = []
        while self.waiting and self.waiting[0].arrival_s <= now and len(self.members) < self.max_batch_size:
            seq = self.waiting.popleft()
            seq.slot = len(self.members)
            self.members.append(seq)

    def _candidates(self, now: float) -> list[Sequence]:
        """Members of the batch not yet running (all of them at first, preempted ones later)."""
        return [s for s in self.members if s.status is Status.WAITING]


POLICIES = {"continuous": ContinuousScheduler, "static": StaticScheduler}
