"""Checks 1 and 2: do the student and each teacher read token ids alike, and what prompt does each see?"""

from __future__ import annotations

from .report import Result, merge


def _short(text: str, limit: int = 60) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit - 5] + "...'"


def first_template_difference(a: str | None, b: str | None) -> str | None:
    """None when the two chat templates are the same bytes, else 'line N: A vs B'."""
    if a == b:
        return None
    a_lines, b_lines = (a or "").splitlines(), (b or "").splitlines()
    for n, (x, y) in enumerate(zip(a_lines, b_lines, strict=False), start=1):
        if x != y:
            col = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            lo = max(0, col - 15)
            return f"line {n}, column {col + 1}: {x[lo:col + 25]!r} vs {y[lo:col + 25]!r}"
    n = min(len(a_lines), len(b_lines)) + 1
    return f"line {n}: one template ends there ({len(a_lines)} vs {len(b_lines)} lines)"


def compare_vocab(student, teacher) -> tuple[str | None, int, int]:
    """(the first id both have that maps to other strings, 'id N: A vs B', or None), and the numbers of ids only
    the student / only the teacher has."""
    s_by_id = {i: tok for tok, i in student.get_vocab().items()}
    t_by_id = {i: tok for tok, i in teacher.get_vocab().items()}
    shared = sorted(s_by_id.keys() & t_by_id.keys())
    first = next((i for i in shared if s_by_id[i] != t_by_id[i]), None)
    where = None if first is None else f"id {first}: {_short(s_by_id[first], 30)} vs {_short(t_by_id[first], 30)}"
    return where, len(s_by_id.keys() - t_by_id.keys()), len(t_by_id.keys() - s_by_id.keys())


def check_pair(label: str, student, teacher, as_is: bool) -> Result:
    """Check 1 for one teacher (or shift side) against the student's tokenizer."""
    parts = []
    mismatch, only_s, only_t = compare_vocab(student, teacher)
    sizes = f"vocab {len(student)} vs {len(teacher)}"
    if mismatch:
        parts.append(Result("tokenizers", "FAIL", f"{label}: {sizes}, first id read differently: {mismatch}",
                            f"give {label.split()[0]} a model with the student's tokenizer (records carry token ids)"
                            + (", or let opd-score score it over the response text (--align auto, --loss rkl or "
                               "uld)" if label.startswith("--teacher") else "")))
    elif only_s or only_t:
        parts.append(Result("tokenizers", "FAIL", f"{label}: {sizes}, shared ids agree; {only_s} ids only the "
                            f"student has, {only_t} only the teacher", "opd-score scores ids only with the "
                            "student's whole vocabulary" + (": use --align auto (over the response text, --loss rkl "
                                                            "or uld)" if label.startswith("--teacher") else "")))
    else:
        parts.append(Result("tokenizers", "PASS", f"{label}: same {len(student)} ids"))
    for name in ("eos_token", "pad_token"):
        s_id, t_id = getattr(student, f"{name}_id"), getattr(teacher, f"{name}_id")
        if s_id != t_id:
            status = "FAIL" if name == "eos_token" else "WARN"
            parts.append(Result("tokenizers", status, f"{label}: {name} id {s_id} ({getattr(student, name)!r}) vs "
                                f"{t_id} ({getattr(teacher, name)!r})",
                                "the teacher must end a turn with the student's EOS, or responses run away"
                                if status == "FAIL" else "set the same pad token on both tokenizers"))
    specials = set(student.all_special_tokens) ^ set(teacher.all_special_tokens)
    if specials:
        parts.append(Result("tokenizers", "WARN", f"{label}: special tokens differ: {sorted(specials)[:4]}",
                            "check that the differing special tokens never appear in prompts or responses"))
    if as_is:
        diff = first_template_difference(student.chat_template, teacher.chat_template)
        if diff:
            parts.append(Result("tokenizers", "FAIL", f"{label}: chat templates differ at {diff}",
                                "an as-is teacher scores the student's prompt ids: give it the student's chat "
                                "template, or render its own prompt with --teacher-prompt TEMPLATE"))
    return merge("tokenizers", parts)


def generation_prefix(tokenizer, thinking: bool) -> str | None:
    """The text a chat template puts between the user's message and the response (its assistant header, with
    an empty think block when thinking is off): the common suffix of two renders. None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    renders = [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=thinking)
               for m in ("QQQ1", "QQQ2")]
    a, b = renders
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n:] if n else ""
