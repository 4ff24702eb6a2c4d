"""A small serving engine in the shape of vLLM: sequences, a paged KV block manager, a scheduler
(static or continuous batching), a model runner over the paged cache, and the loop that drives them."""
from .block_manager import BlockManager, OutOfBlocks
from .llm_engine import Engine, EngineStats, LLMEngine, Outputs, RequestOutput, StepRecord
from .model_runner import ModelRunner, PagedAttention
from .scheduler import POLICIES, Batch, Chunk, ContinuousScheduler, Scheduler, StaticScheduler
from .sequence import Sequence, Status
