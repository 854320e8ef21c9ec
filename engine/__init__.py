"""batchlens engine: continuous batching over a paged KV cache, and the local-PC side."""

from engine.config import EngineConfig, SamplingParams
from engine.engine import Engine, EngineStats, StepStats
from engine.metrics import RequestMetrics, summarize
from engine.models.loaded import LoadedModel
from engine.outputs import RequestHandle, RequestOutput

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "LoadedModel",
    "RequestHandle",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
    "summarize",
]
