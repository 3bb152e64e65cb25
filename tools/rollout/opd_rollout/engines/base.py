"""The engine interface shared by the vllm and hf engines."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from opd_common.errors import ConfigError


@dataclass
class SampleRequest:
    """One sample to draw: the rendered prompt and this sample's own seed."""

    prompt_ids: list[int]
    seed: int


@dataclass
class Completion:
    """What an engine returns for one SampleRequest (arrays aligned to response tokens)."""

    response_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], raw log_softmax of the model's logits
    finish_reason: str  # "stop" | "length"
    text: str
    topk_ids: np.ndarray | None = None  # int32 [T, k]
    topk_logprobs: np.ndarray | None = None  # float32 [T, k]


class Engine(Protocol):
    name: str

    def generate(self, requests: list[SampleRequest]) -> list[Completion]: ...

    def close(self) -> None: ...


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def make_engine(config) -> Engine:
    """Build the engine named by config.engine ("auto" = vllm when importable, else hf)."""
    name = config.engine
    if name == "auto":
        name = "vllm" if vllm_available() else "hf"
    if name == "vllm":
        if not vllm_available():
            raise ConfigError(
                "--engine vllm: the vllm package is not installed; install 'opd[cpu]' (CPU) "
                "or 'opd[gpu]' (GPU), or use --engine hf"
            )
        from .vllm_engine import VllmEngine

        return VllmEngine(config)
    from .hf import HfEngine

    return HfEngine(config)
