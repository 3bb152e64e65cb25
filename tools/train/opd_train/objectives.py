"""The objectives `opd-train --loss` accepts, one registry entry each (docs/architecture.md, Objectives).

An entry says all that the trainer needs to know about an objective:

- ``reads`` / ``hint``: the record fields it reads (docs/losses.md's table), and the fix a user is
  told when a record lacks one of its blocks;
- ``build``: how one record becomes an Example's per-token arrays (aligned to ``response_ids``);
- ``call`` (and ``metrics``): the pure function of losses.py that computes it, on which per-token
  tensors of a chunk, with which options of the config;
- ``compact``: the ids at which the loss reads the logits, if few (under --compile the [N, V] logits
  are compacted to them: model.compact_logits);
- ``reference``, ``self_teacher``, ``group_advantages``, ``adaptive_beta``: extra work of the
  trainer (the base weights' log-probs, a self-teacher's logits, group-normalized rewards, the
  adaptive k3 coefficient); ``defaults``: config fields that depend on the objective.

config.py validates against the registry, data.py builds examples with it, model.py computes the
loss with it and run.py/trainer.py ask it about the extra work. Adding an objective is one entry
here, its pure function in losses.py and its tests. This module imports neither torch nor numpy at
import time: config.py (and so `opd-train --help`) reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opd_common.errors import RecordError

if TYPE_CHECKING:
    from opd_common.records import Where


def _no_options(config) -> dict[str, Any]:
    return {}


def _never(config) -> bool:
    return False


def _one(config) -> float:
    return 1.0


@dataclass(frozen=True)
class Call:
    """``losses.<fn>(logits_NV, *chunk[args], **{k: chunk.get(v) for k, v in kwargs}, **options(config))``.

    A chunk holds the per-token tensors of N positions (``targets_N`` and the Example's ``tokens``),
    what the trainer computed for them (``ref_logp``, ``teacher_logits``) and ``num_tokens``, ``beta``.
    """

    fn: str  # a pure function of losses.py
    args: tuple[str, ...]  # chunk keys, positional after the logits
    kwargs: tuple[tuple[str, str], ...] = ()  # keyword -> chunk key (None where the chunk lacks it)
    options: Callable[[Any], dict[str, Any]] = _no_options  # keywords from the config


@dataclass(frozen=True)
class Objective:
    name: str
    reads: tuple[str, ...]  # record fields it reads, besides prompt_ids and response_ids
    build: Callable[[Objective, Any, dict, Where, Any, Any], None]  # (self, example, rec, where, config, render)
    call: Call
    hint: str = ""  # the fix told when a record lacks a block it reads (a teacher block: teacher_block's)
    metrics: tuple[tuple[str, Call], ...] = ()  # more metrics: name -> call, added to the loss's
    compact: str | None = None  # chunk key of the ids ([N] or [N, K]) at which the loss reads the logits
    temperature: Callable[[Any], float] = _one  # of the softmax the loss takes of the logits
    reference: Callable[[Any], bool] = _never  # needs ref_logp: log p_ref(y_t) of the base weights
    self_teacher: bool = False  # needs teacher_logits: the base weights on the Example's teacher_context
    group_advantages: bool = False  # tokens["advantage"] = the group-normalized reward (needs --batch-groups),
    # and tokens["weight"] under --aggregation response-mean
    adaptive_beta: bool = False  # beta <- losses.update_beta(beta, the step's weighted_shift) after each step
    defaults: tuple[tuple[str, Callable[[Any], Any]], ...] = ()  # config field -> its value when unset (None)
    with_self_teacher: Objective | None = field(default=None, repr=False)  # the variant used with --self-teacher

    def tokens(self, ex, rec: dict, where: Where, config, render=None) -> None:
        """Fill ex (tokens, reward, teacher_context) from the record; errors name the record and field."""
        self.build(self, ex, rec, where, config, render)


def objective(config) -> Objective:
    """The entry config.loss names (its --self-teacher variant when that is set)."""
    obj = OBJECTIVES[config.loss]
    return obj.with_self_teacher if config.self_teacher and obj.with_self_teacher is not None else obj


# --------------------------------------------------------------------------- reading records


def _missing(where: Where, what: str, config, hint: str) -> RecordError:
    return RecordError(f"{where}: {what}, which --loss {config.loss} reads; {hint}")


def teacher_block(rec: dict, where: Where, config) -> tuple[str, dict]:
    """The teachers.NAME block --teacher names (or the record's only one)."""
    teachers = rec.get("teachers") or {}
    name = config.teacher
    if name is None:
        if len(teachers) != 1:
            have = ", ".join(sorted(teachers)) or "none"
            raise RecordError(f"{where}: --loss {config.loss} needs one teacher block, the record has {have}; "
                              "score it with opd-score --teacher NAME=MODEL, or pick one with --teacher NAME")
        name = next(iter(teachers))
    if name not in teachers:
        have = ", ".join(sorted(teachers)) or "none"
        raise RecordError(f"{where}: no teachers.{name} block (the record has {have}); "
                          "check --teacher or score the records with opd-score --teacher")
    return name, teachers[name]


def _f32(values):
    import numpy as np

    return np.asarray(values, np.float32)


def _i64(values):
    import numpy as np

    return np.asarray(values, np.int64)


def _build_sft(obj, ex, rec, where, config, render) -> None:
    pass


def _build_rkl(obj, ex, rec, where, config, render) -> None:
    import torch

    from .losses import rkl_advantages

    _, block = teacher_block(rec, where, config)
    if block.get("text") is not None:  # a teacher with another tokenizer: advantages over aligned chunks
        _build_rkl_chunks(ex, rec, block["text"], config)
        return
    adv = rkl_advantages(torch.tensor(_f32(block["logprobs"])), torch.tensor(_f32(rec["logprobs"])), config.discount)
    ex.tokens.update(behaviour_logp=_f32(rec["logprobs"]), advantage=adv.numpy(), teacher_logp=_f32(block["logprobs"]))


def _build_rkl_chunks(ex, rec, text: dict, config) -> None:
    import torch

    from .losses import chunk_advantages

    behaviour = _f32(rec["logprobs"])
    adv, share = chunk_advantages(torch.tensor(_f32(text["chunk_logprobs"])), torch.tensor(behaviour),
                                  torch.tensor(_i64(text["student_end"])), config.discount)
    ex.tokens.update(behaviour_logp=behaviour, advantage=adv.numpy(), teacher_logp=share.numpy())


def _build_uld(obj, ex, rec, where, config, render) -> None:
    """teacher_probs [T, k]: the teacher's sorted top-k probabilities where a chunk starts (text block) or at
    every token (a teacher with the student's tokenizer); uld_weight [T]: 1 there, else 0."""
    import numpy as np

    name, block = teacher_block(rec, where, config)
    text = block.get("text")
    src = block if text is None else text
    if src.get("topk_logprobs") is None:
        raise _missing(where, f"teachers.{name} has no {'' if text is None else 'text.'}topk_logprobs", config,
                       obj.hint)
    top = -np.sort(-np.exp(_f32(src["topk_logprobs"])), axis=-1)  # sorted: --at-student-topk is in the student's order
    if text is not None and top.size == 0 and text.get("k"):  # a refused record read from JSON: [] has no width
        top = top.reshape(0, int(text["k"]))
    T = len(rec["response_ids"])
    if text is None:
        ex.tokens.update(teacher_probs=top, uld_weight=np.ones(T, np.float32))
        return
    probs, weight = np.zeros((T, top.shape[1]), np.float32), np.zeros(T, np.float32)
    s_end, t_end = _i64(text["student_end"]), _i64(text["teacher_end"])
    s_start, t_start = np.concatenate([[0], s_end[:-1]])[:len(s_end)], np.concatenate([[0], t_end[:-1]])[:len(t_end)]
    probs[s_start], weight[s_start] = top[t_start], 1.0
    ex.tokens.update(teacher_probs=probs, uld_weight=weight)


def _build_fkl(obj, ex, rec, where, config, render) -> None:
    name, block = teacher_block(rec, where, config)
    if block.get("topk_ids") is None or block.get("topk_logprobs") is None:
        raise _missing(where, f"teachers.{name} has no topk_ids/topk_logprobs", config, obj.hint)
    ex.tokens.update(ids=_i64(block["topk_ids"]), teacher_logp=_f32(block["topk_logprobs"]),
                     behaviour_logp=_f32(rec["logprobs"]))  # the ratio and drift metrics only


def _build_fkl_self(obj, ex, rec, where, config, render) -> None:
    ex.teacher_context = _i64(render(rec, where))
    ex.tokens["behaviour_logp"] = _f32(rec["logprobs"])  # the ratio and drift metrics only


def _build_rl(obj, ex, rec, where, config, render) -> None:
    reward = rec.get("reward")
    if not isinstance(reward, dict) or not isinstance(reward.get("total"), (int, float)):
        raise _missing(where, "no reward.total", config, obj.hint)
    ex.reward = float(reward["total"])
    ex.tokens["behaviour_logp"] = _f32(rec["logprobs"])  # the advantage: set per step (group_advantages)


def _build_shift(obj, ex, rec, where, config, render) -> None:
    shift = rec.get("shift")
    if not shift:
        raise _missing(where, "no shift block", config, obj.hint)
    ex.tokens.update(ids=_i64(shift["ids"]), delta=_f32(shift["delta"]))


# --------------------------------------------------------------------------- the registry

# every loss on sampled records reports `drift` (k3 of KL(behaviour || student) at the sampled tokens): how far a
# loop at --max-lag >= 1 lagged; fkl also reports the importance ratio it does not correct for (rkl, grpo and
# dapo report the one they apply)
_DRIFT = (("drift", Call("sampled_drift", ("targets_N", "behaviour_logp", "num_tokens"))),)
_PPO = Call("ppo_clip", ("targets_N", "behaviour_logp", "advantage", "num_tokens"),
            (("ref_logp_N", "ref_logp"), ("token_weight_N", "weight")),
            lambda c: {"clip_low": c.clip_low, "clip_high": c.clip_high, "dual_clip": c.dual_clip,
                       "kl_coef": c.kl_coef})
_RL = dict(reads=("logprobs", "reward.total", "reward.correct"), build=_build_rl, call=_PPO, metrics=_DRIFT,
           hint="score with opd-score --reward math", compact="targets_N", reference=lambda c: bool(c.kl_coef),
           group_advantages=True)

_RATIO = (("ratio", Call("sampled_ratio", ("targets_N", "behaviour_logp", "num_tokens"))), *_DRIFT)
_FKL_SELF = Objective(
    "fkl", reads=("logprobs", "example"), build=_build_fkl_self, self_teacher=True,
    call=Call("fkl_full", ("teacher_logits", "num_tokens"),
              options=lambda c: {"temperature": c.loss_temperature, "clip": c.kl_clip}),
    metrics=_RATIO)

OBJECTIVES: dict[str, Objective] = {obj.name: obj for obj in [
    Objective("sft", reads=(), build=_build_sft, call=Call("sft", ("targets_N", "num_tokens")), compact="targets_N"),
    Objective("rkl", reads=("logprobs", "teachers.NAME.logprobs"), build=_build_rkl, compact="targets_N",
              call=Call("rkl", ("targets_N", "behaviour_logp", "advantage", "num_tokens"),
                        (("teacher_logp_N", "teacher_logp"),), lambda c: {"ratio_clip": c.ratio_clip}),
              metrics=_DRIFT),
    Objective("fkl", reads=("logprobs", "teachers.NAME.topk_ids", "teachers.NAME.topk_logprobs"), build=_build_fkl,
              hint="score with opd-score --topk K or --at-student-topk, or use --self-teacher",
              call=Call("fkl", ("ids", "teacher_logp", "num_tokens"),
                        options=lambda c: {"temperature": c.loss_temperature, "clip": c.kl_clip, "tail": c.fkl_tail}),
              metrics=_RATIO, compact="ids", with_self_teacher=_FKL_SELF),  # softmax(logits) at T 1 (losses.fkl)
    Objective("shift", reads=("shift.ids", "shift.delta"), build=_build_shift,
              hint="score with opd-score --shift post=MODEL,pre=MODEL",
              call=Call("shift", ("ids", "delta", "targets_N", "ref_logp", "num_tokens"), (("beta", "beta"),)),
              reference=lambda c: True, adaptive_beta=True),
    Objective("grpo", **_RL, defaults=(("clip_high", lambda c: c.clip_low), ("dynamic_sampling", lambda c: False))),
    Objective("dapo", **_RL, defaults=(("clip_high", lambda c: 0.28), ("dynamic_sampling", lambda c: True))),
    Objective("uld", reads=("teachers.NAME.text.topk_logprobs", "teachers.NAME.text.student_end",
                            "teachers.NAME.text.teacher_end"), build=_build_uld,
              hint="score with opd-score --teacher NAME=MODEL --topk K",
              call=Call("uld", ("teacher_probs", "uld_weight", "num_tokens"))),
]}
