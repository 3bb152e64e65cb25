"""The engine interface shared by the vllm and hf engines (they import it; it imports neither)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np


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

