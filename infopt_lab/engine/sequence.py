"""One request's state as the engine serves it (tokens, cache progress, timings), and a piece of it fed in a step."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from ..sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"      # queued, or preempted and queued again; holds no KV blocks
    RUNNING = "running"      # admitted: holds KV blocks and a batch slot
    FINISHED = "finished"    # produced max_new_tokens (or EOS)
    FAILED = "failed"        # refused: it can never fit; `error` says why


@dataclass(eq=False)
class Sequence:
    """A request inside the engine: its tokens so far, its settings, its place in the cache and its timings."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float = 0.0                  # when the request arrives, seconds after the engine's clock started
    stop_ids: frozenset[int] = frozenset()  # token ids that end it (its stop tokens and, usually, EOS)
    generator: torch.Generator | None = field(default=None, repr=False)  # its own, seeded: batching cannot change it
    output_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)            # when each new token was ready
    status: Status = Status.WAITING
    num_computed: int = 0                   # tokens whose keys and values are in the cache
    draft_computed: int = 0                 # the same in the draft's cache (speculative decoding)
    slot: int | None = None                 # batch row while running (for the Gantt chart)
    preemptions: int = 0
    recomputed_tokens: int = 0              # cache work redone after preemptions
    looked_up_tokens: int = 0               # tokens it looked up in the prefix cache, over its admissions
    cached_tokens: int = 0                  # of those, tokens found cached: computed by no step of its own
    draft_tokens: int = 0                   # tokens drafted for it (speculative decoding)
    accepted_tokens: int = 0                # of those, kept by the target
    judged_tokens: int = 0                  # drafts the target judged: the kept ones and each first rejection
    spec_rounds: int = 0                    # steps in which it speculated
    error: str | None = None

    @property
    def max_new_tokens(self) -> int:
        """New tokens the request asked for at most."""
        return self.params.max_new_tokens

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens to feed before the next token can be sampled (1 while decoding)."""
        return self.length - self.num_computed

    @property
    def max_length(self) -> int:
        """Tokens the sequence will hold at most: the whole prompt and every new token but the last."""
        return len(self.prompt_ids) + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILED)


@dataclass
class Chunk:
    """A run of one sequence's tokens fed in a step, from position `start`; the last `logits` of them give logits.

    The scheduler makes one per running sequence (a prefill chunk, or the one token of a decode step,
    with `lookahead` slots reserved for draft tokens to verify); speculative decoding makes others from
    them (the draft's catch-up, each proposal, the proposals to verify). Nothing in a chunk changes its sequence.
    """

    seq: Sequence
    start: int               # position of its first token
    ids: list[int]           # the tokens fed
    logits: int = 0          # rows that give logits, the last ones (1: the next token; k + 1: a draft verified)
    lookahead: int = 0       # slots reserved after it for draft tokens (speculative decoding)

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int, lookahead: int = 0) -> "Chunk":
        """The next `num_tokens` uncomputed tokens of `seq`; logits for the next token if they reach its end."""
        start = seq.num_computed
        return cls(seq, start, seq.all_ids[start:start + num_tokens], int(start + num_tokens == seq.length),
                   lookahead)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def extended(self, draft: list[int]) -> "Chunk":
        """The chunk with draft tokens after it, every one of them (and its last own token) giving logits."""
        return replace(self, ids=self.ids + draft, logits=len(draft) + 1)


@dataclass
class SeqOutput:
    """What one step produced for one sequence, as data: the scheduler alone applies it (`update_from_output`)."""

    tokens: list[int] = field(default_factory=list)  # new tokens in order (drafts kept, then the target's); [] if none
    computed: int = 0                   # of the tokens fed, those whose keys and values stay valid in the cache
    draft_computed: int | None = None   # positions valid in the draft's cache after the step; None: the target's
    drafted: int = 0                    # draft tokens proposed for it (speculative decoding)
    accepted: int = 0                   # of those, kept by the target
