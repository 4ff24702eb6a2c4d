"""One request's state as the engine serves it: tokens, cache progress, timings."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Status(Enum):
    WAITING = "waiting"      # queued, or preempted and queued again; holds no KV blocks
    RUNNING = "running"      # admitted: holds KV blocks and a batch slot
    FINISHED = "finished"    # produced max_new_tokens (or EOS)
    FAILED = "failed"        # refused: it can never fit; `error` says why


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0                  # when the request arrives, seconds after the run starts
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0                   # tokens whose keys and values are in the cache
    slot: int | None = None                 # batch row while running (for the Gantt chart)
    first_token_s: float | None = None      # seconds after the run started
    finish_s: float | None = None
    preemptions: int = 0
    recomputed_tokens: int = 0              # cache work redone after preemptions
    error: str | None = None

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

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s
