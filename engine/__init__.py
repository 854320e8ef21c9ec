"""batchlens engine: continuous batching over a paged KV cache, and the local-PC side."""

from engine.config import EngineConfig, SamplingParams
from engine.core import EngineCore, StepStats
from engine.engine import Engine
from engine.local import LocalPC
from engine.metrics import RequestMetrics, summarize
from engine.models.loaded import LoadedModel
from engine.outputs import RequestHandle, RequestOutput
from engine.sequence import TokenLogprob
from engine.serving import ServingSide, ServingStats

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineCore",
    "LoadedModel",
    "LocalPC",
    "RequestHandle",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "ServingSide",
    "ServingStats",
    "StepStats",
    "TokenLogprob",
    "summarize",
]
