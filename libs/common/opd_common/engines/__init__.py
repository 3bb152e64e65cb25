"""Generation engines behind one interface: `engine.generate(requests) -> completions`.

base (the interface) <- hf, vllm_engine (the engines) <- factory (make_engine, which imports the engine it
builds lazily); config holds EngineConfig, the flags every sampling tool shares; sampling the per-sample seeds.
"""

from __future__ import annotations

from .base import Completion, Engine, SampleRequest
from .config import EngineConfig
from .factory import make_engine
from .sampling import derive_seed

__all__ = ["Completion", "Engine", "EngineConfig", "SampleRequest", "derive_seed", "make_engine"]
