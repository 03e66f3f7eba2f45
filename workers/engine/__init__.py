"""The worker engine: paged KV cache, prefix caching with KV events, continuous batching with chunked
prefill, sampling, and the offline `LLM` API. Imports `workers.models` and `kernels`, never `cluster`."""

from .config import EngineConfig
from .engine import EngineCore, EngineStats, RequestOutput
from .kv_events import KVEvent, KVEventKind
from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "EngineCore", "EngineStats", "KVEvent", "KVEventKind", "LLM", "RequestOutput", "SamplingParams"]
