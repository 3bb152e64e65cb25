"""make_engine: the engine a config names. The concrete engines are imported here, lazily, and they import only
base: dependencies go one way (factory -> hf | vllm_engine -> base)."""

from __future__ import annotations

import importlib.util

from opd_common.errors import ConfigError

from .base import Engine


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
