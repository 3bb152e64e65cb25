"""EngineConfig: the model, engine and sampling flags that every sampling tool shares (opd-rollout, opd-eval).

RolloutConfig and EvalConfig are dataclasses built on it: its fields come first in their --help, a tool that
words a flag differently (or has another default) redefines the field, which keeps its place. An engine reads
its settings from an EngineConfig (make_engine(config)).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from opd_common.config import opt
from opd_common.errors import ConfigError
from opd_common.prompts import DEFAULT_TEMPLATE, read_template


@dataclass
class EngineConfig:
    model: str | None = opt(None, "Model folder or Hub id (required).")
    revision: str | None = opt(None, "Model revision (Hub branch, tag or commit).")
    adapter: str | None = opt(None, "peft LoRA adapter folder to sample with.")
    engine: str = opt("auto", "Generation engine; auto = vllm when importable, else hf.",
                      choices=("auto", "vllm", "hf"))
    n: int = opt(1, "Samples per prompt (the group size).", flag="-n")
    temperature: float = opt(1.0, "Sampling temperature (0 = greedy).")
    top_p: float = opt(1.0, "Nucleus sampling mass (1.0 = off).")
    top_k: int = opt(0, "Top-k sampling (0 = off).")
    max_tokens: int = opt(1024, "Maximum new tokens per response.")
    seed: int = opt(0, "Base seed; each sample's seed is derived from it, the prompt id and the sample index.")
    thinking: str = opt("on", "enable_thinking for the chat template (Qwen3 style).", choices=("on", "off"))
    template: str = opt(DEFAULT_TEMPLATE, "User message: a Python format string over the row's fields, or @FILE.")
    max_model_len: int | None = opt(None, "vllm: maximum sequence length (prompt + response).")
    gpu_memory_utilization: float | None = opt(None, "vllm: fraction of GPU memory (of CPU RAM on CPU) [default: "
                                                     "0.9 GPU, 0.25 GPU with --follow, 0.2 CPU].")
    tp: int = opt(1, "vllm: tensor-parallel size.")
    dp: int = opt(1, "vllm: data-parallel size.")
    eager: bool | None = opt(None, "vllm: enforce eager mode (no compilation) [default: on for CPU].")
    dtype: str = opt("auto", "Weights dtype (auto = bfloat16 on GPU, float32 on CPU).",
                     choices=("auto", "float32", "bfloat16", "float16"))
    device: str = opt("auto", "hf: torch device (auto = cuda when available).")
    batch_size: int = opt(64, "hf: samples decoded together in one batch.")

    # Read by the engines but a flag of opd-rollout only (RolloutConfig makes it a field); other tools sample
    # without top-k log-probs. (The engines read --follow, --cuda-graph and --compile with getattr defaults.)
    topk_logprobs = 0

    def __post_init__(self) -> None:
        self.check_model()
        self.check_engine()

    def check_model(self) -> None:
        if not self.model:
            raise ConfigError("--model is required (a model folder or Hub id)")

    def check_engine(self) -> None:
        """The sampling and engine flags' values; reads --template @FILE."""
        if self.n < 1:
            raise ConfigError(f"-n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        check_positive(self, "batch_size", "tp", "dp")
        self.template = read_template(self.template)

    def engine_config(self, **changes) -> EngineConfig:
        """This config's EngineConfig fields alone, with `changes` (e.g. the adapter a tool resolved itself)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**(values | changes))


def check_positive(config, *names: str) -> None:
    """Each named field must be >= 1 (the error names its flag)."""
    for name in names:
        if getattr(config, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
