"""Shared fixtures: tiny models built offline once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3 (seed 0) + trained BPE tokenizer, loadable by transformers and vLLM."""
    from opd_common.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    """A second tiny model with the same tokenizer and different weights (seed 1)."""
    from opd_common.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "teacher", seed=1)
