"""Checks 5-7: teacher = student through the real trainer, top-k truncation, stops and the grader."""

from __future__ import annotations

import numpy as np

from opd_common.errors import OpdError

from .report import Result, merge

# |loss| and grad norm of one step at teacher = student that pass, per dtype (10x fails).
SELF_TOLERANCE = {"float32": (1e-5, 1e-4), "bfloat16": (1e-3, 1e-2), "float16": (1e-3, 1e-2)}
TOPK_LADDER = (8, 16, 32, 64, 128, 256, 512)
TOPK_BAR = 0.05  # a k is enough when its mean |top-k KL - full KL| is within 5% of the mean full KL


def _self_records(ctx) -> tuple[list[dict], dict]:
    """The samples made on-policy for the trainer's first step (behaviour = the base weights, which a fresh LoRA
    is) with a teacher that is that same student; and the opd-train options of the run's objective."""
    import torch

    cfg = ctx.config
    options: dict = {}
    out = []
    for rec in ctx.samples():
        rec = dict(rec)
        logits_TV = ctx.base_logits(rec)
        logp_TV = torch.log_softmax(logits_TV, -1)
        ids = torch.from_numpy(np.asarray(rec["response_ids"], np.int64))
        rec["logprobs"] = logp_TV.gather(-1, ids[:, None])[:, 0].numpy()
        if cfg.loss == "rkl":
            rec["teachers"] = {"self": {"model": cfg.model, "logprobs": rec["logprobs"].copy()}}
        elif cfg.loss in ("fkl", "uld") and not cfg.self_teacher:
            values, top = torch.topk(logp_TV, min(cfg.topk, logp_TV.shape[-1]), -1)
            rec["teachers"] = {"self": {"model": cfg.model, "topk_ids": top.numpy().astype(np.int32),
                                        "topk_logprobs": values.numpy()}}
        elif cfg.loss == "shift":
            top = torch.topk(logp_TV, min(cfg.shift_k, logp_TV.shape[-1]), -1).indices.numpy().astype(np.int32)
            rec["shift"] = {"post": cfg.model, "pre": cfg.model, "k": top.shape[1], "ids": top,
                            "delta": np.zeros(top.shape, np.float32)}
        elif cfg.loss in ("grpo", "dapo"):
            rec["reward"] = {"total": 1.0, "correct": True}
        out.append(rec)
    if cfg.loss in ("rkl", "fkl", "uld") and not cfg.self_teacher:
        options["teacher"] = "self"
    if cfg.loss == "fkl":
        options.update(loss_temperature=cfg.loss_temperature, kl_clip=cfg.kl_clip or 0, fkl_tail=cfg.fkl_tail)
        if cfg.self_teacher:  # teacher = student: the self-teacher on the student's own prompt
            options.update(self_teacher="student", self_teacher_thinking=cfg.thinking)
    if cfg.loss in ("grpo", "dapo"):
        options.update(batch_groups=len({r["prompt_id"] for r in out}), batch_size=None, dynamic_sampling=False,
                       kl_coef=cfg.kl_coef)
    return out, options


def check_self(ctx) -> Result:
    """One opd-train step on the samples with teacher = student: the objective must be 0 with a zero gradient."""
    cfg = ctx.config
    if cfg.loss == "sft":
        return Result("self", "SKIP", "--loss sft has no teacher")
    if cfg.self_teacher and cfg.template != ctx.default_template():
        return Result("self", "SKIP", "--self-teacher with a custom --template: the student's own prompt is not a "
                      "bundled template, so teacher = student cannot be set up")
    from opd_common.streams import encode

    from .stages import train_one_step

    records, options = _self_records(ctx)
    options.setdefault("batch_size", len(records))
    path = ctx.work / "self.jsonl"
    path.write_bytes(b"".join(encode(r) for r in records))
    metrics = train_one_step(cfg, path, ctx.work, options)
    loss, grad = abs(float(metrics["loss"])), float(metrics["grad_norm"])
    loss_tol, grad_tol = SELF_TOLERANCE[ctx.dtype_name()]
    figure = f"opd-train --loss {cfg.loss} with teacher = student: loss {loss:.2g}, grad norm {grad:.2g}"
    values = {"loss": loss, "grad_norm": grad}
    if loss <= loss_tol and grad <= grad_tol:
        return Result("self", "PASS", figure, values=values)
    status = "FAIL" if loss > 10 * loss_tol or grad > 10 * grad_tol else "WARN"
    return Result("self", status, figure + f" (tolerance {loss_tol:g}, {grad_tol:g})",
                  "the objective is not zero at identity: check --loss-temperature, --fkl-tail and --kl-clip "
                  "(docs/losses.md)", values=values)


def bucket_kl(logp_t_V, logp_s_V, k: int, tau: float) -> float:
    """KL(teacher || student) over the teacher's top-k ids plus one tail bucket, built at temperature 1 and
    tempered (q ∝ P^(1/tau)), as opd-train's fkl does (docs/losses.md)."""
    import torch

    top = torch.topk(logp_t_V, k).indices
    rest = torch.ones_like(logp_t_V, dtype=torch.bool)
    rest[top] = False
    buckets = []
    for logp in (logp_t_V, logp_s_V):  # the tail's mass summed over its ids, not 1 - head (exact when p -> 1)
        tail = torch.logsumexp(logp[rest], 0)
        buckets.append(torch.log_softmax(torch.cat([logp[top], tail[None]]) / tau, -1))
    return _kl(*buckets)


def _kl(t_logq, s_logq) -> float:
    """sum q_T (log q_T - log q_S), with 0 log 0 = 0."""
    import torch

    terms = torch.where(t_logq > -torch.inf, t_logq.exp() * (t_logq - s_logq), torch.zeros_like(t_logq))
    return float(terms.sum())


def full_kl(logp_t_V, logp_s_V, tau: float) -> float:
    import torch

    return _kl(torch.log_softmax(logp_t_V / tau, -1), torch.log_softmax(logp_s_V / tau, -1))


def check_topk(ctx) -> Result:
    """fkl over an opd-score teacher's top-k: the teacher's mass outside k and the KL error that k implies."""
    cfg = ctx.config
    if cfg.loss != "fkl" or cfg.self_teacher or not cfg.teachers:
        return Result("topk", "SKIP", "no top-k teacher (--loss fkl with --teacher)" if not cfg.self_teacher
                      else "--self-teacher: the full vocabulary, no truncation")
    import torch

    teacher = cfg.teachers[0]
    label = f"--teacher {teacher.name}={teacher.model}"
    if not ctx.same_vocab(label):
        return Result("topk", "SKIP", f"{label} has another vocabulary (tokenizers check): no shared top-k")
    vocab = None
    tails: dict[int, list[float]] = {}
    errors: dict[int, list[float]] = {}
    fulls = []
    for rec in ctx.samples():
        t_logp = torch.log_softmax(ctx.teacher_logits(teacher, rec).double(), -1)
        s_logp = torch.log_softmax(ctx.trainer_logits(rec).double(), -1)
        if t_logp.shape != s_logp.shape:
            return Result("topk", "SKIP", f"{label} has {t_logp.shape[-1]} logits, the student "
                          f"{s_logp.shape[-1]}: no shared top-k (tokenizers check)")
        vocab = t_logp.shape[-1]
        ladder = sorted({k for k in (*TOPK_LADDER, cfg.topk) if k < vocab})
        for t in range(t_logp.shape[0]):
            full = full_kl(t_logp[t], s_logp[t], cfg.loss_temperature)
            fulls.append(full)
            sorted_p = t_logp[t].exp().sort(descending=True).values
            for k in ladder:
                tails.setdefault(k, []).append(float(1 - sorted_p[:k].sum()))
                errors.setdefault(k, []).append(abs(bucket_kl(t_logp[t], s_logp[t], k, cfg.loss_temperature) - full))
    scale = max(float(np.mean(fulls)), 1e-12)
    enough = [k for k in sorted(errors) if np.mean(errors[k]) <= TOPK_BAR * scale]
    suggest = enough[0] if enough else max(errors)
    k = cfg.topk if cfg.topk in errors else max(errors)
    tail, err = float(np.mean(tails[k])), float(np.mean(errors[k]))
    figure = (f"{label} at --topk {k}: mass outside it {tail:.3g} (mean, p95 {np.percentile(tails[k], 95):.3g}), "
              f"|top-k KL - full KL| {err:.3g} per token against a full KL of {scale:.3g} (tau "
              f"{cfg.loss_temperature:g}, unclipped); smallest k within {TOPK_BAR:.0%}: {suggest}")
    values = {"k": k, "tail_mass": tail, "kl_error": err, "full_kl": scale, "suggested_k": suggest,
              "ladder": {str(j): float(np.mean(errors[j])) for j in sorted(errors)}}
    if err <= TOPK_BAR * scale:
        return Result("topk", "PASS", figure, values=values)
    return Result("topk", "WARN", figure, f"use --topk {suggest} (opd-score) for a KL within {TOPK_BAR:.0%}",
                  values=values)


def check_stops(ctx) -> Result:
    """How samples end, and whether the grader can say 'correct' to a gold answer written as the student writes."""
    cfg = ctx.config
    recs = ctx.samples()
    cut = sum(r["finish_reason"] == "length" for r in recs)
    eos_seen = any(r["finish_reason"] == "stop" for r in recs)
    share = cut / len(recs)
    figure = f"{cut}/{len(recs)} samples hit --max-tokens {cfg.max_tokens}"
    if not eos_seen:
        parts = [Result("stops", "WARN", figure + "; no sample ended with EOS", "if responses run away, check the "
                        "model's EOS (tokenizers check); else raise --max-tokens", values={"length_share": share})]
    elif share > 0.5:
        parts = [Result("stops", "WARN", figure, "most responses are cut off: raise --max-tokens (a truncated "
                        "box is no answer)", values={"length_share": share})]
    else:
        parts = [Result("stops", "PASS", figure, values={"length_share": share})]
    golds = {r["prompt_id"]: str(r["example"]["answer"]) for r in recs if (r.get("example") or {}).get("answer")
             is not None}
    if not golds:
        parts.append(Result("stops", "PASS", "no gold answers in the prompts: grader not checked"))
        return merge("stops", parts)
    from opd_common.grading import Grader

    items = [(f"The answer is $\\boxed{{{gold}}}$.", gold) for gold in golds.values()]
    try:
        with Grader(workers=1) as grader:
            grades = grader.grade(items, cfg.grader)
    except OpdError as exc:  # e.g. a gold the integer grader cannot read
        parts.append(Result("stops", "FAIL", f"--grader {cfg.grader} cannot grade these prompts: {exc}",
                            "choose the --grader that fits the gold answers"))
        return merge("stops", parts)
    rejected = [(pid, gold) for (pid, gold), g in zip(golds.items(), grades, strict=True) if not g.correct]
    if rejected:
        pid, gold = rejected[0]
        parts.append(Result("stops", "FAIL", f"--grader {cfg.grader} rejects {len(rejected)}/{len(golds)} gold "
                            f"answers written as \\boxed{{gold}} (first: {gold!r} of {pid})",
                            "choose the --grader that fits these answers (math reads any LaTeX; integer only "
                            "integers)"))
    else:
        parts.append(Result("stops", "PASS", f"--grader {cfg.grader} accepts all {len(golds)} gold answers as "
                            "\\boxed{gold}"))
    return merge("stops", parts)
