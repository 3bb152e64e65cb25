"""EvalConfig: every `opd-eval run` flag, validated in one place.

Sampling and engine flags mean what they mean in opd-rollout; `rollout_config()` turns them into
the RolloutConfig that opd-rollout's engines take, so both tools sample the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from opd_common.config import opt
from opd_common.errors import ConfigError
from opd_common.grading import MODES
from opd_rollout.config import DEFAULT_TEMPLATE  # the OPSD evaluation prompt (DESIGN.md section 6)

# What was measured: the results' `sampling` block. `compare` requires equal values for all but
# the seed (other seeds are other samples of the same protocol); `--resume` requires all equal.
SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "n", "thinking", "template", "problem_field", "grader",
            "seed")
ROLLOUT_FIELDS = ("model", "revision", "engine", "n", "temperature", "top_p", "top_k", "max_tokens", "seed",
                  "thinking", "id_field", "template", "max_model_len", "gpu_memory_utilization",
                  "tp", "dp", "eager", "dtype", "device", "batch_size", "quiet")


@dataclass
class EvalConfig:
    model: str | None = opt(None, "Base model folder or Hub id (required).")
    revision: str | None = opt(None, "Model revision (Hub branch, tag or commit).")
    adapter: str | None = opt(None, "peft LoRA adapter folder to evaluate (or use --run-dir/--checkpoint).")
    run_dir: str | None = opt(None, "opd-train run directory holding checkpoint-NNNNNN/ adapters.")
    checkpoint: str | None = opt(None, "With --run-dir: a step number or 'latest' [default: latest]; "
                                       "0 without a checkpoint-000000 = the base model.")
    bench: str | None = opt(None, "Bundled benchmark: aime24, aime25, hmmt25, math500 (see `opd-eval ls`).")
    data: str | None = opt(None, "Your own benchmark: a JSONL(.zst) file of problems with gold answers.")
    problem_field: str = opt("problem", "Row field holding the problem (read by the default template).")
    answer_field: str = opt("answer", "Row field holding the gold answer.")
    id_field: str = opt("id", "Row field used as the problem id (default: FILE-LINE when absent).")
    template: str = opt(DEFAULT_TEMPLATE, "User message: a Python format string over the row's fields, or @FILE.")
    limit: int | None = opt(None, "Evaluate only the first N problems.")
    engine: str = opt("auto", "Generation engine (as opd-rollout); auto = vllm when importable, else hf.",
                      choices=("auto", "vllm", "hf"))
    n: int = opt(1, "Samples per problem (avg@n; the seeds use 12 on AIME).", flag="-n")
    temperature: float = opt(1.0, "Sampling temperature (0 = greedy).")
    top_p: float = opt(1.0, "Nucleus sampling mass (1.0 = off).")
    top_k: int = opt(0, "Top-k sampling (0 = off).")
    max_tokens: int = opt(38912, "Maximum new tokens per response (the seeds' AIME setting).")
    seed: int = opt(0, "Base seed; each sample's seed is derived from it, the problem id and the sample index.")
    thinking: str = opt("on", "enable_thinking for the chat template (Qwen3 style).", choices=("on", "off"))
    grader: str = opt("math", "math (math-verify + normalized strings) or integer (AIME-style relaxed integers).",
                      choices=MODES)
    grade_workers: int | None = opt(None, "Grader worker processes [default: min(4, CPUs)].")
    grade_timeout: float = opt(5.0, "math-verify time limit per call, in seconds.")
    chunk: int = opt(256, "Samples per engine call; each finished chunk is graded and saved to the progress file.")
    out: str | None = opt(None, "Results JSON file to write (required).", short="-o")
    resume: bool = opt(False, "Continue an interrupted evaluation from OUT.progress.jsonl.")
    overwrite: bool = opt(False, "Replace earlier results (or an unfinished evaluation) in --out.")
    keep_text: bool = opt(True, "Keep each response's text in the results' sample rows.")
    max_model_len: int | None = opt(None, "vllm: maximum sequence length (prompt + response).")
    gpu_memory_utilization: float | None = opt(None, "vllm: fraction of GPU memory (of CPU RAM on CPU).")
    tp: int = opt(1, "vllm: tensor-parallel size.")
    dp: int = opt(1, "vllm: data-parallel size (one engine replica per GPU group).")
    eager: bool | None = opt(None, "vllm: enforce eager mode [default: on for CPU].")
    dtype: str = opt("auto", "Weights dtype (auto = bfloat16 on GPU, float32 on CPU).",
                     choices=("auto", "float32", "bfloat16", "float16"))
    device: str = opt("auto", "hf: torch device (auto = cuda when available).")
    batch_size: int = opt(64, "hf: samples decoded together in one batch.")
    quiet: bool = opt(False, "No progress bar.")

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required (a model folder or Hub id)")
        if (self.bench is None) == (self.data is None):
            raise ConfigError("give exactly one of --bench NAME (see `opd-eval ls`) or --data FILE")
        if self.adapter and self.run_dir:
            raise ConfigError("--adapter and --run-dir both name the adapter; give one of them")
        if self.checkpoint is not None and not self.run_dir:
            raise ConfigError("--checkpoint needs --run-dir (the opd-train run directory that holds it)")
        if not self.out:
            raise ConfigError("--out is required: the results JSON file to write (e.g. --out base.json)")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other; give one of them")
        if self.chunk < 1:
            raise ConfigError(f"--chunk must be >= 1, got {self.chunk}")
        if self.grade_timeout <= 0:
            raise ConfigError(f"--grade-timeout must be > 0, got {self.grade_timeout}")
        if self.grade_workers is not None and self.grade_workers < 1:
            raise ConfigError(f"--grade-workers must be >= 1, got {self.grade_workers}")
        self.template = self.rollout_config().template  # validates the shared flags, reads @FILE

    def rollout_config(self, adapter: str | None = None):
        """The RolloutConfig opd-rollout's engines take (same flags, same validation)."""
        from opd_rollout.config import RolloutConfig

        values = {name: getattr(self, name) for name in ROLLOUT_FIELDS}
        return RolloutConfig(adapter=adapter, limit=self.limit, prompt_field=self.problem_field, **values)

    def sampling(self) -> dict:
        """The settings that define what was measured (the results' `sampling` block)."""
        return {name: getattr(self, name) for name in SAMPLING}
