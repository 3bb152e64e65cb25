"""RolloutConfig: every opd-rollout flag, validated in one place (the shared ones in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from opd_common.config import opt
from opd_common.engines.config import EngineConfig, check_positive
from opd_common.errors import ConfigError


@dataclass
class RolloutConfig(EngineConfig):
    cuda_graph: bool | None = opt(None, "hf: replay the decode step as a CUDA graph [default: on for CUDA].")
    compile: bool = opt(False, "hf: torch.compile the decode forward (slow first batch, faster decoding).")
    prompt_field: str = opt("problem", "Row field that holds the prompt: text (read by the template's {problem}) "
                                       "or a list of {role, content} messages [default: problem, else prompt, "
                                       "messages, question].")
    id_field: str = opt("id", "Row field used as prompt_id (else verl's extra_info.index, else SOURCE-LINE).")
    topk_logprobs: int = opt(0, "Also record the behaviour policy's top-k ids and log-probs per token.")
    limit: int | None = opt(None, "Read at most this many prompts.")
    follow: str | None = opt(None, "On-policy loop: an opd-train run dir (--save-every 1); before each batch of "
                                   "--batch-prompts prompts, wait for its trainer and sample with its newest "
                                   "checkpoint.")
    max_lag: int = opt(0, "--follow: batches this rollout may run ahead of the trainer (0 = strictly on-policy).")
    follow_timeout: float = opt(3600.0, "--follow: seconds to wait for the trainer before giving up.")
    max_lora_rank: int = opt(64, "--follow with vLLM: the largest LoRA rank the engine accepts.")
    batch_prompts: int = opt(256, "Prompts gathered per engine call (fewer when input trickles in).")
    out: str | None = opt(None, "Write shards + manifest.json to this directory instead of stdout.")
    shard_size: int = opt(1000, "Records per shard with --out.")
    encoding: str = opt("packed", "Per-token arrays: packed (base64 typed, fast) or json (plain lists).",
                        choices=("packed", "json"))
    compress: bool = opt(False, "zstd-compress stdout.")
    overwrite: bool = opt(False, "Replace an earlier output in --out.")
    quiet: bool = opt(False, "No progress bar.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.topk_logprobs < 0:
            raise ConfigError(f"--topk-logprobs must be >= 0, got {self.topk_logprobs}")
        check_positive(self, "batch_prompts", "shard_size")
        if self.follow and self.adapter:
            raise ConfigError("--follow loads the run's newest checkpoint itself; drop --adapter")
        if self.max_lag < 0:
            raise ConfigError(f"--max-lag must be >= 0, got {self.max_lag}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
