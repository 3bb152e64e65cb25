"""CheckConfig: opd-check's flags, spelled as the stages it guards spell them (opd-rollout's sampling flags,
opd-score's teachers, opd-train's objective)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opd_common.config import opt
from opd_common.engines.config import EngineConfig
from opd_common.errors import ConfigError

LOSSES = ("sft", "rkl", "fkl", "shift", "grpo", "dapo", "uld")
TEXT_LOSSES = ("rkl", "uld")  # the objectives that learn from a teacher with another tokenizer (aligned chunks)


@dataclass
class CheckConfig(EngineConfig):
    # opd-rollout
    prompt_field: str = opt("problem", "Row field that holds the prompt (as opd-rollout).")
    id_field: str = opt("id", "Row field used as prompt_id (as opd-rollout).")
    limit: int = opt(4, "Prompts to sample (each -n times): a few are enough.")
    # opd-score
    teacher: list[str] = opt([], "NAME=MODEL[@REVISION][+ADAPTER]: a teacher of the run (repeatable), as opd-score.",
                             multiple=True)
    shift: str | None = opt(None, "post=MODEL,pre=MODEL: the Direct-OPD pair, as opd-score.")
    shift_k: int = opt(16, "opd-score --shift-k.")
    teacher_prompt: str = opt("as-is", "as-is or a template (bundled name or file), as opd-score.")
    teacher_thinking: str = opt("on", "enable_thinking for the teacher's template, as opd-score.",
                                choices=("on", "off"))
    align: str = opt("auto", "opd-score --align: auto (token ids when a teacher's tokenizer is the student's, "
                     "else text chunks), ids or text.", choices=("auto", "ids", "text"))
    topk: int = opt(16, "opd-score --topk K (fkl, uld): the k whose truncation is measured.")
    grader: str = opt("math", "opd-score / opd-eval --grader.", choices=("math", "integer"))
    # opd-train
    loss: str = opt("rkl", "opd-train --loss.", choices=LOSSES)
    loss_temperature: float = opt(1.0, "opd-train --loss-temperature (fkl).")
    kl_clip: float | None = opt(0.05, "opd-train --kl-clip (fkl; 0 = off).")
    fkl_tail: bool = opt(True, "opd-train --fkl-tail/--no-fkl-tail.")
    self_teacher: str | None = opt(None, "opd-train --self-teacher TEMPLATE (fkl).")
    self_teacher_thinking: str = opt("on", "opd-train --self-teacher-thinking.", choices=("on", "off"))
    kl_coef: float = opt(0.0, "opd-train --kl-coef (grpo/dapo).")
    # opd-check
    json: bool = opt(False, "Print the checks as one JSON object on stdout instead of lines.")
    keep: str | None = opt(None, "Keep the samples, scored records and the trainer's run in this folder.")
    quiet: bool = opt(False, "No progress on stderr.")
    teachers: list = field(default_factory=list, metadata={"cli": False})
    shift_pair: tuple[str, str] | None = field(default=None, metadata={"cli": False})

    def __post_init__(self) -> None:
        super().__post_init__()
        from opd_common.teachers import TeacherSpec, parse_shift

        self.teachers = [TeacherSpec.parse(t) for t in self.teacher]
        self.shift_pair = parse_shift(self.shift) if self.shift else None
        if self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if not 1 <= self.topk:
            raise ConfigError(f"--topk must be >= 1, got {self.topk}")
        if self.loss_temperature <= 0:
            raise ConfigError(f"--loss-temperature must be > 0, got {self.loss_temperature}")
        if self.kl_clip == 0:
            self.kl_clip = None
        if self.self_teacher and self.loss != "fkl":
            raise ConfigError("--self-teacher goes with --loss fkl (as in opd-train)")
        if self.loss in ("rkl", "fkl", "uld") and not (self.teachers or self.self_teacher):
            raise ConfigError(f"--loss {self.loss} learns from a teacher: give --teacher NAME=MODEL (as opd-score) "
                              "or --self-teacher TEMPLATE (fkl)")
        if self.loss == "shift" and not self.shift_pair:
            raise ConfigError("--loss shift learns from the Direct-OPD pair: give --shift post=MODEL,pre=MODEL")
