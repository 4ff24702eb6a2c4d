"""What a run of the engine did: per-step records and the run's totals (throughput, rows, cache, speculation)."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    """What a run of the engine did: requests, tokens, steps, rows, preemptions, KV blocks, and a timeline."""

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
    prefix_lookup_tokens: int = 0   # tokens looked up in the prefix cache on admission (0 without it)
    prefix_hit_tokens: int = 0      # of those, found cached: prefill work saved
    draft_tokens: int = 0           # tokens drafted (speculative decoding)
    accepted_tokens: int = 0        # of those, kept by the target
    judged_tokens: int = 0          # drafts judged: the kept ones and each round's first rejected one
    spec_rounds: int = 0            # a sequence's draft verified: one per sequence per step that speculated
    max_batch_size: int = 1
    block_size: int = 16
    max_seq_len: int = 0
    kv_blocks_total: int = 0
    kv_blocks_peak: int = 0
    decode_attention: dict[str, dict[str, int]] = field(default_factory=dict)   # per model ("target", "draft"):
                                    # steps of single decode tokens by path ("paged kernel", "gather", "cascade")
    timeline: list[StepRecord] = field(default_factory=list, repr=False)

    @property
    def throughput_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up tokens found in the prefix cache."""
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else float("nan")

    @property
    def prefix_blocks_saved(self) -> int:
        """Blocks of keys and values reused from the prefix cache instead of computed."""
        return self.prefix_hit_tokens // self.block_size

    @property
    def acceptance_rate(self) -> float:
        """alpha, the per-token acceptance of the formula: kept / judged drafts (speculative.py's definition)."""
        return self.accepted_tokens / self.judged_tokens if self.judged_tokens else float("nan")

    @property
    def draft_yield(self) -> float:
        """Share of drafted tokens the target kept."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")

    @property
    def tokens_per_round(self) -> float:
        """New tokens per speculating sequence per step: the kept drafts and the target's own."""
        return (self.accepted_tokens + self.spec_rounds) / self.spec_rounds if self.spec_rounds else float("nan")

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
        cache = (f", prefix cache hits {self.prefix_hit_rate:.1%} ({self.prefix_blocks_saved} blocks saved)"
                 if self.prefix_lookup_tokens else "")
        cache += (f", draft acceptance {self.acceptance_rate:.1%} ({self.tokens_per_round:.2f} tokens per round)"
                  if self.draft_tokens else "")
        return (f"{self.generated_tokens} tokens in {self.wall_s:.2f} s = {self.throughput_tok_s:.1f} tok/s, "
                f"{self.steps} steps, utilization {self.utilization:.1%}, occupancy {self.occupancy:.1%}, "
                f"preemptions {self.preemptions}, KV blocks peak {self.kv_blocks_peak}/{self.kv_blocks_total}"
                f"{cache}")
