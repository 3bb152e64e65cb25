"""Generation engines behind one interface: `engine.generate(requests) -> completions`."""

from __future__ import annotations

from .base import Completion, Engine, SampleRequest, make_engine

__all__ = ["Completion", "Engine", "SampleRequest", "make_engine"]
