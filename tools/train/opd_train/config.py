"""TrainConfig: every opd-train flag, validated in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass

from opd_common.config import opt
from opd_common.errors import ConfigError

from .objectives import OBJECTIVES

LOSSES = tuple(OBJECTIVES)  # sft, rkl, fkl, shift, grpo, dapo
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclass
class TrainConfig:
    model: str | None = opt(None, "Student base model folder or Hub id (required).")
    revision: str | None = opt(None, "Student model revision.")
    out: str | None = opt(None, "Run directory: config.json, metrics.jsonl, checkpoint-NNNNNN/, latest (required).")
    loss: str = opt("rkl", "Objective (docs/losses.md).", choices=LOSSES)
    max_steps: int | None = opt(None, "Hard budget: exactly this many optimizer steps, also across --resume "
                                      "(required).")
    allow_short: bool = opt(False, "Accept input that ends before --max-steps (otherwise an error).")
    # batching
    batch_groups: int | None = opt(None, "Groups (all samples of one prompt_id) per optimizer step.")
    batch_size: int | None = opt(None, "Records per optimizer step (instead of --batch-groups).")
    micro_batch_tokens: int = opt(8192, "Padded tokens per forward/backward (micro-batch size x longest sequence).")
    logit_chunk: int = opt(2048, "Positions per LM-head chunk (bounds the [positions x vocab] buffers).")
    # loss options
    teacher: str | None = opt(None, "Teacher block (teachers.NAME) for rkl/fkl [default: the records' only one].")
    ratio_clip: float | None = opt(None, "rkl: truncate the importance ratio at this value (off when unset).")
    discount: float = opt(0.0, "rkl: discount of future per-token advantages (0 = per-token).")
    kl_clip: float | None = opt(0.05, "fkl: clip of each KL summand (OPSD: 0.05); --kl-clip 0 turns it off.")
    loss_temperature: float = opt(1.0, "fkl: temperature dividing both sides' logits (OPSD: 1.1).")
    fkl_tail: bool = opt(True, "fkl: add the tail bucket (a true KL); --no-fkl-tail = OPSD's renormalized top-k.")
    self_teacher: str | None = opt(None, "fkl: teacher = the base weights (adapter off) on this prompt template "
                                         "(opsd, student or a file), full-vocabulary KL; no teacher data needed.")
    self_teacher_thinking: str = opt("on", "enable_thinking for the self-teacher's prompt.", choices=("on", "off"))
    clip_low: float = opt(0.2, "grpo/dapo: lower clip of the importance ratio (1 - clip_low).")
    clip_high: float | None = opt(None, "grpo/dapo: upper clip (1 + clip_high) [default: 0.28 for dapo (clip-higher), "
                                        "clip_low for grpo].")
    dual_clip: float | None = opt(10.0, "grpo/dapo: dual clip c for negative advantages (0 = off).")
    kl_coef: float = opt(0.0, "grpo/dapo: coefficient of the k3 KL to the base model (adapter off); 0 = none.")
    dynamic_sampling: bool | None = opt(None, "grpo/dapo: drop groups whose correctness is all equal and read more "
                                              "[default: on for dapo, off for grpo].")
    aggregation: str = opt("token-mean", "grpo/dapo: token-mean (each token of the step weighs the same; DAPO) or "
                                         "response-mean (mean over each response's tokens, then over the step's "
                                         "responses; the GRPO paper).", choices=("token-mean", "response-mean"))
    max_candidate_batches: int = opt(10, "dynamic sampling: fail the step (resume later) after reading this many "
                                         "batches' worth of groups without filling it.")
    max_staleness: int | None = opt(None, "Drop records with policy.version < steps done - S (whole groups with "
                                          "--batch-groups); 0 = only the newest checkpoint's samples (on-policy).")
    beta_init: float = opt(2.5, "shift: initial coefficient of the k3 KL to the initial student.")
    beta_eps: float = opt(0.01, "shift: multiplicative step of the adaptive coefficient.")
    # LoRA
    lora_r: int = opt(16, "LoRA rank.")
    lora_alpha: float = opt(32.0, "LoRA alpha.")
    lora_dropout: float = opt(0.0, "LoRA dropout.")
    lora_targets: str = opt(DEFAULT_TARGETS, "Comma-separated module names to adapt, or all-linear.")
    # optimizer
    lr: float = opt(1e-5, "AdamW learning rate.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    warmup_steps: int = opt(0, "Linear warm-up steps.")
    lr_schedule: str = opt("constant", "After warm-up.", choices=("constant", "linear", "cosine"))
    max_grad_norm: float | None = opt(1.0, "Clip the global gradient norm (0 = off).")
    # run
    save_every: int | None = opt(None, "Checkpoint every N steps (and always at the end).")
    share_policy: bool = opt(False, "After every step, hand the adapter to the loop's followers in RUN/policy/ "
                                    "(no optimizer state, no fsync; opd-rollout --follow samples with it): the "
                                    "fast hand-over, and checkpoints need not be every step.")
    publish: str | None = opt(None, "Publish each checkpoint as it is saved (opd-publish push to hf://ORG/NAME or "
                                    "file:///DIR); a failed or unverified publish stops the run.")
    input_continues: bool = opt(False, "With --resume: the inputs continue after what the run read (e.g. a restarted "
                                       "opd-rollout --follow); skip nothing instead of re-reading the same inputs.")
    resume: bool = opt(False, "Continue the run in --out from its latest checkpoint (same options).")
    overwrite: bool = opt(False, "Replace an earlier run in --out.")
    seed: int = opt(0, "Seed for LoRA initialization and dropout.")
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass (less memory).")
    compile: bool = opt(False, "torch.compile the decoder (slow first steps, then faster on GPU).")
    dtype: str = opt("auto", "Base weights dtype (auto = bfloat16 on GPU, float32 on CPU); LoRA weights are fp32.",
                     choices=("auto", "float32", "bfloat16"))
    device: str = opt("auto", "Torch device when not under accelerate launch (auto = cuda when available).")
    metrics_stdout: bool = opt(False, "Also print each step's metrics as a JSON line on stdout.")
    quiet: bool = opt(False, "No progress bar.")

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required (the student base model)")
        if not self.out:
            raise ConfigError("--out is required (the run directory)")
        if self.max_steps is None or self.max_steps < 1:
            raise ConfigError(f"--max-steps is required and must be >= 1, got {self.max_steps}")
        if (self.batch_groups is None) == (self.batch_size is None):
            raise ConfigError("give exactly one of --batch-groups (prompt groups per step) or --batch-size (records)")
        for name in ("batch_groups", "batch_size", "micro_batch_tokens", "logit_chunk", "lora_r", "save_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.kl_clip is not None and self.kl_clip < 0:
            raise ConfigError(f"--kl-clip must be >= 0 (0 = off), got {self.kl_clip}")
        if self.kl_clip == 0:
            self.kl_clip = None
        if self.max_grad_norm == 0:
            self.max_grad_norm = None
        if self.loss_temperature <= 0:
            raise ConfigError(f"--loss-temperature must be > 0, got {self.loss_temperature}")
        if not 0 <= self.discount <= 1:
            raise ConfigError(f"--discount must be in [0, 1], got {self.discount}")
        if self.ratio_clip is not None and self.ratio_clip <= 0:
            raise ConfigError(f"--ratio-clip must be > 0, got {self.ratio_clip}")
        self._objective_options()
        for name in ("clip_low", "clip_high", "kl_coef"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.dual_clip == 0:
            self.dual_clip = None
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"--dual-clip must be > 1 (or 0 = off), got {self.dual_clip}")
        if self.input_continues and not self.resume:
            raise ConfigError("--input-continues goes with --resume")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0, got {self.max_staleness}")
        if self.max_candidate_batches < 1:
            raise ConfigError(f"--max-candidate-batches must be >= 1, got {self.max_candidate_batches}")
        if not 0.5 <= self.beta_init <= 2.5:
            raise ConfigError(f"--beta-init must be in [0.5, 2.5] (the adaptive coefficient's clamp), "
                              f"got {self.beta_init}")
        if not 0 <= self.beta_eps < 1:
            raise ConfigError(f"--beta-eps must be in [0, 1), got {self.beta_eps}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under accelerate launch: FSDP settings it cannot honour
            from .distributed import fsdp_settings

            fsdp_settings()

    def _objective_options(self) -> None:
        """What --loss's registry entry (objectives.py) requires of the other options, and its defaults."""
        obj = OBJECTIVES.get(self.loss)
        if obj is None:
            raise ConfigError(f"--loss {self.loss!r}: choose one of {', '.join(OBJECTIVES)} (docs/losses.md)")
        if self.self_teacher and obj.with_self_teacher is None:
            losses = " or ".join(name for name, o in OBJECTIVES.items() if o.with_self_teacher is not None)
            raise ConfigError(f"--self-teacher goes with --loss {losses} (the full-vocabulary forward KL)")
        if self.aggregation != "token-mean" and not obj.group_advantages:
            losses = " or ".join(name for name, o in OBJECTIVES.items() if o.group_advantages)
            raise ConfigError(f"--aggregation {self.aggregation} goes with --loss {losses}; the other losses are "
                              "token means over the step")
        if obj.group_advantages and self.batch_groups is None:
            raise ConfigError(f"--loss {self.loss} needs --batch-groups (advantages are normalized within groups)")
        for name, default in obj.defaults:
            if getattr(self, name) is None:
                setattr(self, name, default(self))
