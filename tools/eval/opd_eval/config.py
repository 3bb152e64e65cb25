"""EvalConfig: every `opd-eval run` flag, validated in one place.

Sampling and engine flags are EngineConfig's, the ones opd-rollout has, so both tools sample the same way;
the engine is built from this config's EngineConfig (`engine_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from opd_common.config import opt
from opd_common.engines.config import EngineConfig
from opd_common.errors import ConfigError
from opd_common.grading import MODES

# What was measured: the results' `sampling` block. `compare` requires equal values for all but
# the seed (other seeds are other samples of the same protocol); `--resume` requires all equal.
SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "n", "thinking", "template", "problem_field", "grader",
            "seed")


@dataclass
class EvalConfig(EngineConfig):
    # EngineConfig's fields, worded for evaluation (or with another default)
    model: str | None = opt(None, "Base model folder or Hub id (required).")
    adapter: str | None = opt(None, "peft LoRA adapter folder to evaluate (or use --run-dir/--checkpoint).")
    engine: str = opt("auto", "Generation engine (as opd-rollout); auto = vllm when importable, else hf.",
                      choices=("auto", "vllm", "hf"))
    n: int = opt(1, "Samples per problem (avg@n; the seeds use 12 on AIME).", flag="-n")
    max_tokens: int = opt(38912, "Maximum new tokens per response (the seeds' AIME setting).")
    seed: int = opt(0, "Base seed; each sample's seed is derived from it, the problem id and the sample index.")
    gpu_memory_utilization: float | None = opt(None, "vllm: fraction of GPU memory (of CPU RAM on CPU).")
    dp: int = opt(1, "vllm: data-parallel size (one engine replica per GPU group).")
    eager: bool | None = opt(None, "vllm: enforce eager mode [default: on for CPU].")
    # opd-eval's own
    run_dir: str | None = opt(None, "opd-train run directory holding checkpoint-NNNNNN/ adapters.")
    checkpoint: str | None = opt(None, "With --run-dir: a step number or 'latest' [default: latest]; "
                                       "0 without a checkpoint-000000 = the base model.")
    bench: str | None = opt(None, "Bundled benchmark: aime24, aime25, hmmt25, math500 (see `opd-eval ls`).")
    data: str | None = opt(None, "Your own benchmark: problems with gold answers in a JSONL(.zst) or parquet file, "
                                 "a parquet or datasets save_to_disk folder, or hf://datasets/ORG/NAME[@REV][:SPLIT].")
    problem_field: str = opt("problem", "Row field holding the problem (read by the default template).")
    answer_field: str = opt("answer", "Row field holding the gold answer.")
    id_field: str = opt("id", "Row field used as the problem id (default: FILE-LINE when absent).")
    limit: int | None = opt(None, "Evaluate only the first N problems.")
    grader: str = opt("math", "math (math-verify + normalized strings) or integer (AIME-style relaxed integers).",
                      choices=MODES)
    grade_workers: int | None = opt(None, "Grader worker processes [default: min(4, CPUs)].")
    grade_timeout: float = opt(5.0, "math-verify time limit per call, in seconds.")
    chunk: int = opt(256, "Samples per engine call; each finished chunk is graded and saved to the progress file.")
    out: str | None = opt(None, "Results JSON file to write (required).", short="-o")
    resume: bool = opt(False, "Continue an interrupted evaluation from OUT.progress.jsonl.")
    overwrite: bool = opt(False, "Replace earlier results (or an unfinished evaluation) in --out.")
    keep_text: bool = opt(True, "Keep each response's text in the results' sample rows.")
    quiet: bool = opt(False, "No progress bar.")

    def __post_init__(self) -> None:
        self.check_model()
        self._check_eval()
        self.check_engine()  # the shared flags; reads --template @FILE
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")

    def _check_eval(self) -> None:
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

    def sampling(self) -> dict:
        """The settings that define what was measured (the results' `sampling` block)."""
        return {name: getattr(self, name) for name in SAMPLING}
