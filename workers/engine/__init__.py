"""The worker engine: paged KV cache, prefix caching with KV events, continuous batching with chunked
prefill, sampling, and the offline `LLM` API. Imports `workers.models` and `kernels`, never `cluster`.

Names are imported lazily so that light users (the router, config parsing, `moray --help`) do not pay
for loading JAX.
"""

import importlib

_EXPORTS = {
    "EngineConfig": ".config",
    "EngineCore": ".engine",
    "EngineStats": ".engine",
    "TokenDelta": ".engine",
    "RequestOutput": ".output_processor",
    "KVEvent": ".kv_events",
    "KVEventKind": ".kv_events",
    "LLM": ".llm",
    "SamplingParams": ".sampling_params",
    "StructuredOutputs": ".sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
