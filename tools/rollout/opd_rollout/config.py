"""RolloutConfig: every opd-rollout flag, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass

from opd_common.config import opt
from opd_common.errors import ConfigError

# The OPSD student / evaluation prompt (DESIGN.md section 6), a Python format string over the row.
DEFAULT_TEMPLATE = "Problem: {problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."


@dataclass
class RolloutConfig:
    model: str | None = opt(None, "Model folder or Hub id (required).")
    revision: str | None = opt(None, "Model revision (Hub branch, tag or commit).")
    adapter: str | None = opt(None, "peft LoRA adapter folder to sample with.")
    engine: str = opt("auto", "Generation engine; auto = vllm when importable, else hf.", choices=("auto", "vllm", "hf"))
    n: int = opt(1, "Samples per prompt (the group size).", flag="-n")
    temperature: float = opt(1.0, "Sampling temperature (0 = greedy).")
    top_p: float = opt(1.0, "Nucleus sampling mass (1.0 = off).")
    top_k: int = opt(0, "Top-k sampling (0 = off).")
    max_tokens: int = opt(1024, "Maximum new tokens per response.")
    seed: int = opt(0, "Base seed; each sample's seed is derived from it, the prompt id and the sample index.")
    thinking: str = opt("on", "enable_thinking for the chat template (Qwen3 style).", choices=("on", "off"))
    prompt_field: str = opt("problem", "Row field that holds the problem (used by the default template).")
    id_field: str = opt("id", "Row field used as prompt_id (default: SOURCE-LINE when absent).")
    template: str = opt(DEFAULT_TEMPLATE, "User message: a Python format string over the row's fields, or @FILE.")
    topk_logprobs: int = opt(0, "Also record the behaviour policy's top-k ids and log-probs per token.")
    limit: int | None = opt(None, "Read at most this many prompts.")
    follow: str | None = opt(None, "On-policy loop: an opd-train run dir (--save-every 1); before each batch of "
                                   "--batch-prompts prompts, wait for its trainer and sample with its newest checkpoint.")
    max_lag: int = opt(0, "--follow: batches this rollout may run ahead of the trainer (0 = strictly on-policy).")
    follow_timeout: float = opt(3600.0, "--follow: seconds to wait for the trainer before giving up.")
    max_lora_rank: int = opt(64, "--follow with vLLM: the largest LoRA rank the engine accepts.")
    max_model_len: int | None = opt(None, "vllm: maximum sequence length (prompt + response).")
    gpu_memory_utilization: float | None = opt(None, "vllm: fraction of GPU memory (of CPU RAM on CPU) [default: 0.9 GPU, 0.25 GPU with --follow, 0.2 CPU].")
    tp: int = opt(1, "vllm: tensor-parallel size.")
    dp: int = opt(1, "vllm: data-parallel size.")
    eager: bool | None = opt(None, "vllm: enforce eager mode (no compilation) [default: on for CPU].")
    dtype: str = opt("auto", "Weights dtype (auto = bfloat16 on GPU, float32 on CPU).",
                     choices=("auto", "float32", "bfloat16", "float16"))
    device: str = opt("auto", "hf: torch device (auto = cuda when available).")
    batch_size: int = opt(64, "hf: samples decoded together in one batch.")
    cuda_graph: bool | None = opt(None, "hf: replay the decode step as a CUDA graph [default: on for CUDA].")
    compile: bool = opt(False, "hf: torch.compile the decode forward (slow first batch, faster decoding).")
    batch_prompts: int = opt(256, "Prompts gathered per engine call (fewer when input trickles in).")
    out: str | None = opt(None, "Write shards + manifest.json to this directory instead of stdout.")
    shard_size: int = opt(1000, "Records per shard with --out.")
    encoding: str = opt("packed", "Per-token arrays: packed (base64 typed, fast) or json (plain lists).",
                        choices=("packed", "json"))
    compress: bool = opt(False, "zstd-compress stdout.")
    overwrite: bool = opt(False, "Replace an earlier output in --out.")
    quiet: bool = opt(False, "No progress bar.")

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required (a model folder or Hub id)")
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
        if self.topk_logprobs < 0:
            raise ConfigError(f"--topk-logprobs must be >= 0, got {self.topk_logprobs}")
        for name in ("batch_size", "batch_prompts", "shard_size", "tp", "dp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.follow and self.adapter:
            raise ConfigError("--follow loads the run's newest checkpoint itself; drop --adapter")
        if self.max_lag < 0:
            raise ConfigError(f"--max-lag must be >= 0, got {self.max_lag}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if self.template.startswith("@"):
            try:
                with open(self.template[1:], encoding="utf-8") as f:
                    self.template = f.read()
            except OSError as exc:
                raise ConfigError(f"--template {self.template}: cannot read the file ({exc.strerror})") from None
