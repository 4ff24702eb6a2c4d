"""A small serving engine in the shape of vLLM: sequences, a paged KV block manager (with prefix caching),
a scheduler (static or continuous batching), a model runner over the paged cache, speculative decoding
inside the batch, and the loop that drives them; plus an agentic multi-turn workload to serve."""
from .block_manager import BlockManager, OutOfBlocks
from .llm_engine import Engine, LLMEngine, Outputs, RequestOutput
from .model_runner import AttentionMetadata, ModelRunner, PagedAttention
from .scheduler import POLICIES, Batch, ContinuousScheduler, Scheduler, StaticScheduler
from .sequence import Chunk, SeqOutput, Sequence, Status
from .spec_decode import NGRAM, Speculator
from .stats import EngineStats, StepRecord
from .workload import AgenticWorkload, SessionRun, agentic_workload, run_sessions
