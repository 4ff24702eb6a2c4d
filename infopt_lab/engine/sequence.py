"""One request's state as the engine serves it: tokens, cache progress, timings."""
from __future__ import annotations

from dataclasses import dataclass, field
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
