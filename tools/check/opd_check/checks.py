"""Checks 1-4 (tokenizers, rendering, log-probs, adapter delivery) over a Context (run.py)."""

from __future__ import annotations

import numpy as np

from .report import Result, merge
from .tokenizers import check_pair, generation_prefix

# (mean, max) |rollout log-prob - trainer log-prob| that pass, per dtype; 10x the mean fails.
LOGPROB_TOLERANCE = {"float32": (1e-4, 5e-3), "bfloat16": (2e-2, 1.0), "float16": (5e-3, 0.5)}
SAMPLED_AT_1 = ("rkl", "grpo", "dapo")  # objectives whose ratio and advantages treat samples as drawn at T = 1


def _ends(text: str, keep: int = 160) -> str:
    """A long prompt shown by its two ends."""
    if len(text) <= 2 * keep:
        return repr(text)
    return f"{text[:keep]!r} ... ({len(text) - 2 * keep} characters) ... {text[-keep:]!r}"


def check_tokenizers(ctx) -> Result:
    sides = ctx.teacher_sides()
    if not sides:
        return Result("tokenizers", "SKIP", "no --teacher or --shift: the student is its own teacher")
    as_is = ctx.config.teacher_prompt == "as-is"
    parts = []
    for label, model, revision, _ in sides:
        if ctx.over_text(label):
            parts.append(check_text_teacher(ctx, label, ctx.tokenizer(model, revision)))
        else:
            parts.append(check_pair(label, ctx.student_tokenizer(), ctx.tokenizer(model, revision), as_is))
    return merge("tokenizers", parts)


def check_text_teacher(ctx, label: str, tokenizer) -> Result:
    """A teacher with another tokenizer that opd-score scores over the response text (--align auto or text):
    how the samples align (opd_common.xtok, as opd-score aligns them), and whether --loss can learn from it."""
    from opd_common.xtok import Aligner

    from .config import TEXT_LOSSES

    cfg = ctx.config
    if cfg.loss not in TEXT_LOSSES:
        return Result("tokenizers", "FAIL", f"{label} has another tokenizer (opd-score scores it over the response "
                      f"text) but --loss {cfg.loss} reads the teacher at the student's token ids",
                      f"use --loss {' or '.join(TEXT_LOSSES)} (aligned chunks), or a teacher with the student's "
                      "tokenizer")
    aligner = Aligner(ctx.student_tokenizer(), tokenizer, label, same_vocab=ctx.same_vocab(label),
                      student_flag="--model")
    counts = {"ok": 0, "partial": 0, "refused": 0}
    covered = total = 0
    reason = ""
    for rec in ctx.samples():
        al = aligner(rec["response_ids"], rec.get("finish_reason") == "stop")
        counts[al.status] += 1
        total += len(rec["response_ids"])
        covered += int(al.student_end[-1]) if len(al.student_end) else 0
        reason = reason or al.reason
    figure = (f"{label}: another tokenizer, scored over the response text: {counts['ok']} samples aligned, "
              f"{counts['partial']} partial, {counts['refused']} refused; {covered}/{total} student tokens in "
              "aligned chunks")
    values = {"aligned": counts["ok"], "partial": counts["partial"], "refused": counts["refused"],
              "tokens_in_chunks": covered, "tokens": total}
    if counts["refused"] == sum(counts.values()):
        return Result("tokenizers", "FAIL", figure + f" ({reason})", "no sample aligns: this teacher gives no "
                      "signal; pick a teacher whose tokenizer reproduces the text", values=values)
    return Result("tokenizers", "WARN" if counts["refused"] else "PASS", figure + (f" ({reason})" if reason else ""),
                  "refused samples get no teacher signal (docs/records.md, teachers with another tokenizer)",
                  values=values)


def check_rendering(ctx) -> Result:
    """The prompts the student and each teacher see for the first sample, and the response they score."""
    cfg = ctx.config
    rec = ctx.samples()[0]
    student = ctx.student_tokenizer()
    prompt = student.decode(rec["prompt_ids"])
    prefix = generation_prefix(student, cfg.thinking == "on")
    parts = [Result("rendering", "PASS", f"{rec['id']}: student prompt {len(rec['prompt_ids'])} tokens",
                    details=[f"student prompt (thinking {cfg.thinking}): {_ends(prompt)}"])]
    if prefix is not None and not prompt.endswith(prefix):
        parts.append(Result("rendering", "FAIL", f"the student prompt does not end with its template's assistant "
                            f"prefix {prefix!r}", "render prompts with the model's chat template (opd-rollout does)"))
    response, verbatim = student.decode(rec["response_ids"]), False
    for label, context_ids, tokenizer, thinking in ctx.teacher_contexts(rec):
        parts.append(Result("rendering", "PASS", "", details=[
            f"{label} prompt ({len(context_ids)} tokens, thinking {thinking}): {_ends(tokenizer.decode(context_ids))}",
            f"{label} reads the response {_after(ctx, label, tokenizer, thinking)}"]))
        if ctx.over_text(label):
            continue
        verbatim = True
        theirs = tokenizer.decode(rec["response_ids"])
        if theirs != response:
            at = next((i for i, (a, b) in enumerate(zip(response, theirs, strict=False)) if a != b),
                      min(len(response), len(theirs)))
            parts.append(Result("rendering", "FAIL", f"{label} reads the student's response ids as other text "
                                f"(from character {at}: {theirs[at:at + 20]!r} vs {response[at:at + 20]!r})",
                                "teacher and student must share a tokenizer (see the tokenizers check)"))
    if verbatim:
        parts[0].figure += f"; teachers score its {len(rec['response_ids'])} response ids verbatim"
    return merge("rendering", parts)


def _after(ctx, label: str, tokenizer, thinking: str) -> str:
    """What a teacher's context ends with before the response."""
    if ctx.over_text(label):
        how = "the student's prompt, as text" if ctx.config.teacher_prompt == "as-is" else "its own prompt"
        return f"as text in its own tokens, after {how}"
    prefix = generation_prefix(tokenizer, thinking == "on")
    return "after its prompt (no chat template)" if prefix is None else f"after {prefix!r}"


def temperature_result(cfg) -> Result | None:
    """Sampling settings the objective does not expect (None when they fit)."""
    if cfg.loss in SAMPLED_AT_1 and cfg.temperature != 1:
        return Result("logprobs", "FAIL", f"rollout samples at --temperature {cfg.temperature} but --loss "
                      f"{cfg.loss} treats samples as drawn at temperature 1 (its ratio and advantages use the "
                      "raw log-probs)", f"sample at --temperature 1 for --loss {cfg.loss}")
    if cfg.loss in SAMPLED_AT_1 and (cfg.top_p < 1 or cfg.top_k):
        return Result("logprobs", "WARN", f"rollout truncates sampling (--top-p {cfg.top_p}, --top-k {cfg.top_k}) "
                      f"but --loss {cfg.loss} treats samples as drawn from the whole distribution",
                      "sample with --top-p 1 --top-k 0")
    if cfg.loss == "fkl" and cfg.temperature != cfg.loss_temperature:
        return Result("logprobs", "WARN", f"rollout samples at --temperature {cfg.temperature}, the loss compares "
                      f"at --loss-temperature {cfg.loss_temperature}", "OPSD samples at its loss temperature "
                      "(1.1 both): make them equal unless the difference is deliberate")
    return None


def check_logprobs(ctx) -> Result:
    """Rollout log-probs against the trainer's forward (adapter on, temperature 1) on the sampled tokens."""
    cfg = ctx.config
    diffs, ratios = [], []
    for rec in ctx.samples():
        trainer = ctx.trainer_logprobs(rec)
        diffs.append(np.abs(trainer - rec["logprobs"]))
        ratios.append(np.exp(trainer - rec["logprobs"]))
    diff, ratio = np.concatenate(diffs), float(np.concatenate(ratios).mean())
    mean_tol, max_tol = LOGPROB_TOLERANCE[ctx.dtype_name()]
    mean, worst = float(diff.mean()), float(diff.max())
    figure = (f"|rollout - trainer| mean {mean:.2g}, max {worst:.2g} over {diff.size} tokens ({ctx.dtype_name()}, "
              f"{ctx.engine_name()}); importance ratio at step 0 {ratio:.4f}")
    values = {"mean_abs_diff": mean, "max_abs_diff": worst, "ratio": ratio, "tokens": int(diff.size)}
    if mean <= mean_tol and worst <= max_tol:
        parts = [Result("logprobs", "PASS", figure, values=values)]
    else:
        status = "FAIL" if mean > 10 * mean_tol else "WARN"
        parts = [Result("logprobs", status, figure + f" (tolerance mean {mean_tol:g}, max {max_tol:g})",
                        "the engine and the trainer compute different distributions: check --dtype, the adapter "
                        "(next check) and that the engine reports raw log-probs (before temperature)", values=values)]
    extra = temperature_result(cfg)
    return merge("logprobs", parts + ([extra] if extra else []))


def check_adapter(ctx) -> Result:
    """The adapter folder names the model's modules, changes the model, and the engine sampled with it."""
    cfg = ctx.config
    if not cfg.adapter:
        return Result("adapter", "SKIP", "no --adapter (an --follow loop loads the run's adapters itself)")
    from .forward import unmatched_lora_keys

    unmatched, nonzero, total = unmatched_lora_keys(cfg.adapter, cfg.model, cfg.revision)
    if unmatched:
        return Result("adapter", "FAIL", f"{len(unmatched)} of the LoRA tensors in {cfg.adapter} name no module of "
                      f"{cfg.model} (first: {unmatched[0]}): peft leaves those layers at zero, so the adapter is "
                      "not loaded", "save the adapter from a peft model of this base model (the keys must be "
                      "base_model.model.<module>.lora_A/B.weight)")
    if nonzero == 0:
        return Result("adapter", "WARN", f"every lora_B tensor of {cfg.adapter} is zero ({total}): the adapter "
                      "leaves the base model unchanged", "is this a freshly initialised adapter?")
    engine_vs_base, engine_vs_peft, peft_vs_base = [], [], []
    for rec in ctx.samples():
        base, peft = ctx.base_logprobs(rec), ctx.trainer_logprobs(rec)
        engine_vs_base.append(np.abs(rec["logprobs"] - base))
        engine_vs_peft.append(np.abs(rec["logprobs"] - peft))
        peft_vs_base.append(np.abs(peft - base))
    gap_base, gap_peft = (float(np.concatenate(x).mean()) for x in (engine_vs_base, engine_vs_peft))
    effect = float(np.concatenate(peft_vs_base).mean())
    figure = (f"{nonzero}/{total} lora_B tensors non-zero; adapter moves log-probs by {effect:.3g} (mean); "
              f"engine vs peft {gap_peft:.2g}, engine vs base {gap_base:.2g}")
    values = {"effect": effect, "engine_vs_peft": gap_peft, "engine_vs_base": gap_base}
    mean_tol, _ = LOGPROB_TOLERANCE[ctx.dtype_name()]
    if effect <= mean_tol:
        return Result("adapter", "FAIL", figure + ": the non-zero adapter changes nothing once loaded",
                      "check the adapter's target modules and scaling (adapter_config.json)", values=values)
    if gap_base < gap_peft:
        return Result("adapter", "FAIL", figure + ": the engine sampled with the base weights",
                      f"the adapter never reached the {ctx.engine_name()} engine (with vLLM: --max-lora-rank >= the "
                      "adapter's rank)", values=values)
    return Result("adapter", "PASS", figure, values=values)
