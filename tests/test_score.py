"""opd-score (hf engine) on the tiny models: teachers, privileged prompts, shift, rewards, errors, streams, resume.

Every number is checked against a plain reference: AutoModelForCausalLM in float32, one forward
of the whole sequence (context + response), log_softmax over the full vocabulary, read at
positions P-1 .. P+T-2. Most tests call the click command in-process (CliRunner); the pipeline
test runs the console scripts as a real shell pipeline. The vLLM engine has test_score_vllm.py.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import threading
from pathlib import Path

import numpy as np
import orjson
import pytest
from click.testing import CliRunner
from test_rollout import BIN, _line_reader, load_model, load_tokenizer, ok, parse, read_after, rollout

from opd_common.models import render_chat
from opd_common.prompts import bundled_dir, load
from opd_common.streams import MANIFEST, PROGRESS, encode, iter_inputs, sha256_file
from opd_score import cli

# Teacher log-probs against the reference forward. Measured max abs diff on the tiny models (CPU,
# float32): 1.9e-6 (sampled tokens), 2.4e-6 (own top-k, at the student's ids, shift delta), 1.7e-6
# (student as its own teacher vs the rollout's log-probs). 1e-4 leaves room for kernel changes and
# is still far below the gaps the tests also check (another model, another prompt: > 1e-2).
TOL = 1e-4

# The rollouts every test scores: 3 AIME prompts x 2 samples, top-8 student log-probs. Prompts are
# 94-243 tokens, responses 6-8 tokens.
ROLLOUT_ARGS = ["-n", "2", "--max-tokens", "8", "--limit", "3", "--temperature", "0.7", "--topk-logprobs", "8",
                "aime24"]

# The OPSD prompts (docs/architecture.md, Templates), verbatim (Python str.format strings; the dash in
# TRANSITION is an em dash).
STUDENT = "Problem: {problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
TEACHER = ("Problem: {problem}\n\n"
           "Here is a reference solution to this problem:\n"
           "=== Reference Solution Begin ===\n{solution}\n=== Reference Solution End ===\n"
           "{transition}\n"
           "Please reason step by step, and put your final answer within \\boxed{{}}.")
TRANSITION = ("\n\nAfter reading the reference solution above, make sure you truly understand the "
              "reasoning behind each step — do not copy or paraphrase it. Now, using your own words "
              "and independent reasoning, derive the same final answer to the problem above. Think "
              "step by step, explore different approaches, and don't be afraid to backtrack or "
              "reconsider if something doesn't work out:\n")
THINK_OFF = "<think>\n\n</think>\n\n"


# --------------------------------------------------------------------------- helpers


def score(*args: str, input: str | bytes | None = None):
    """Invoke opd-score in-process (no progress bar)."""
    return CliRunner().invoke(cli.command, ["--quiet", *args], input=input)


def reference(lm, context_ids, response_ids):
    """log_softmax [T, V] of a plain full-sequence forward, at the positions predicting the response."""
    import torch

    context, response = list(map(int, context_ids)), list(map(int, response_ids))
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([context + response])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(context) - 1:len(context) + len(response) - 1]


def at(logprobs_TV, ids) -> np.ndarray:
    """Gather [T] (ids [T]) or [T, k] (ids [T, k]) log-probs from a [T, V] tensor."""
    import torch

    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    return (logprobs_TV.gather(-1, ids[:, None])[:, 0] if ids.ndim == 1 else logprobs_TV.gather(-1, ids)).numpy()


def max_diff(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max(initial=0.0))


def opsd_context(tokenizer, example: dict, thinking: bool) -> list[int]:
    """The OPSD teacher prompt built by hand: the documented text through the chat template, once."""
    text = TEACHER.format(problem=example["problem"], solution=example["solution"], transition=TRANSITION)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=thinking)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def write_records(path: Path, recs: list[dict]) -> str:
    path.write_bytes(b"".join(encode(r) for r in recs))
    return str(path)


def error_of(result) -> str:
    assert result.exit_code == 1, f"exit {result.exit_code}: {result.output}"
    assert result.stdout == ""
    return result.stderr


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def rollouts(tiny_model, tmp_path_factory):
    """(path of the rollout file, its records)."""
    result = ok(rollout(tiny_model, *ROLLOUT_ARGS))
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    path.write_bytes(result.stdout_bytes)
    recs = parse(result.stdout_bytes)
    assert len(recs) == 6 and all(r["topk_ids"].shape[1] == 8 for r in recs)
    return str(path), recs


@pytest.fixture(scope="module")
def student_lm(tiny_model):
    return load_model(tiny_model)


@pytest.fixture(scope="module")
def teacher_lm(tiny_teacher):
    return load_model(tiny_teacher)


@pytest.fixture(scope="module")
def scored(rollouts, tiny_teacher):
    """The rollouts scored by the teacher, as-is, sampled tokens and own top-5."""
    path, _ = rollouts
    return parse(ok(score("--teacher", f"t={tiny_teacher}", "--topk", "5", path)).stdout_bytes)


# --------------------------------------------------------------------------- teachers


def test_teacher_logprobs_equal_a_full_forward(rollouts, scored, tiny_teacher, teacher_lm):
    _, recs = rollouts
    assert [r["id"] for r in scored] == [r["id"] for r in recs]
    worst = other_model = 0.0
    for rec in scored:
        block = rec["teachers"]["t"]
        assert set(block) == {"model", "revision", "adapter", "prompt", "logprobs", "topk", "topk_ids", "topk_logprobs"}
        assert (block["model"], block["revision"], block["adapter"], block["prompt"]) == \
               (str(tiny_teacher), None, None, "as-is")
        expected = at(reference(teacher_lm, rec["prompt_ids"], rec["response_ids"]), rec["response_ids"])
        worst = max(worst, max_diff(block["logprobs"], expected))
        other_model = max(other_model, max_diff(block["logprobs"], rec["logprobs"]))
    assert worst <= TOL
    assert other_model > 1.0  # the teacher really is another model (measured ~10)


def test_own_topk_is_the_teachers_top_k(scored, teacher_lm):
    import torch

    for rec in scored:
        block = rec["teachers"]["t"]
        assert block["topk"] == "teacher"
        values_TK, ids_TK = torch.topk(reference(teacher_lm, rec["prompt_ids"], rec["response_ids"]), 5, dim=-1)
        np.testing.assert_array_equal(block["topk_ids"], ids_TK.numpy(), err_msg=rec["id"])
        assert max_diff(block["topk_logprobs"], values_TK.numpy()) <= TOL
        assert np.all(np.diff(block["topk_logprobs"], axis=1) <= 0)  # sorted, best first
        assert not np.array_equal(block["topk_ids"], rec["topk_ids"][:, :5])  # not the student's ids


def test_at_student_topk_scores_the_records_ids(rollouts, tiny_teacher, teacher_lm):
    path, recs = rollouts
    got = parse(ok(score("--teacher", f"t={tiny_teacher}", "--at-student-topk", path)).stdout_bytes)
    for rec, src in zip(got, recs, strict=True):
        block = rec["teachers"]["t"]
        assert block["topk"] == "student"
        np.testing.assert_array_equal(block["topk_ids"], src["topk_ids"])
        expected = reference(teacher_lm, rec["prompt_ids"], rec["response_ids"])
        assert max_diff(block["topk_logprobs"], at(expected, src["topk_ids"])) <= TOL
        assert max_diff(block["logprobs"], at(expected, rec["response_ids"])) <= TOL


@pytest.mark.parametrize("prompt", ["as-is", "student"])
def test_student_as_its_own_teacher_reproduces_the_rollout(rollouts, tiny_model, prompt):
    """As-is, and re-rendered through the bundled 'student' template with thinking on (the rollout's
    own prompt): the teacher log-probs are the rollout's behaviour log-probs."""
    path, recs = rollouts
    got = parse(ok(score("--teacher", f"self={tiny_model}", "--teacher-prompt", prompt, "--teacher-thinking", "on",
                         path)).stdout_bytes)
    worst = max(max_diff(rec["teachers"]["self"]["logprobs"], src["logprobs"])
                for rec, src in zip(got, recs, strict=True))
    assert worst <= TOL
    assert {rec["teachers"]["self"]["prompt"] for rec in got} == {prompt}


@pytest.mark.parametrize("thinking", ["on", "off"])
def test_privileged_opsd_prompt_equals_a_full_forward(rollouts, scored, tiny_teacher, teacher_lm, thinking):
    path, recs = rollouts
    got = parse(ok(score("--teacher", f"t={tiny_teacher}", "--teacher-prompt", "opsd", "--teacher-thinking", thinking,
                         path)).stdout_bytes)
    tokenizer = load_tokenizer(tiny_teacher)
    worst = gap = 0.0
    for rec, src, as_is in zip(got, recs, scored, strict=True):
        context = opsd_context(tokenizer, src["example"], thinking == "on")
        # the tool's own rendering (template + chat template, applied once) gives exactly these ids
        assert render_chat(tokenizer, load("opsd").render(src["example"], rec["id"]), thinking == "on") == context
        text = tokenizer.decode(context)
        assert "=== Reference Solution Begin ===" in text and "— do not copy" in text
        assert text.endswith("<|im_start|>assistant\n" + THINK_OFF) is (thinking == "off")
        assert (THINK_OFF in text) is (thinking == "off")
        block = rec["teachers"]["t"]
        assert block["prompt"] == "opsd"
        worst = max(worst, max_diff(block["logprobs"], at(reference(teacher_lm, context, src["response_ids"]),
                                                         src["response_ids"])))
        gap = max(gap, max_diff(block["logprobs"], as_is["teachers"]["t"]["logprobs"]))
    assert worst <= TOL
    assert gap > 0.01  # the privileged context really changes the teacher's log-probs (measured ~1)


def test_jinja_template_file(rollouts, tiny_model, student_lm, tmp_path):
    """A user's Jinja template renders the teacher's message from the example's fields."""
    path, recs = rollouts
    template = tmp_path / "hint.j2"
    template.write_text("{{ problem }}\nHint: the answer is {{ answer }}.")
    assert (load(str(template)).kind, load(str(template)).fields()) == ("jinja", ["answer", "problem"])
    (rec,) = parse(ok(score("--teacher", f"h={tiny_model}", "--teacher-prompt", str(template),
                            "--teacher-thinking", "off", "-", input=encode(recs[0]))).stdout_bytes)
    tokenizer = load_tokenizer(tiny_model)
    context = tokenizer(f"<|im_start|>user\n{recs[0]['example']['problem']}\nHint: the answer is "
                        f"{recs[0]['example']['answer']}.<|im_end|>\n<|im_start|>assistant\n{THINK_OFF}",
                        add_special_tokens=False)["input_ids"]
    expected = at(reference(student_lm, context, rec["response_ids"]), rec["response_ids"])
    assert max_diff(rec["teachers"]["h"]["logprobs"], expected) <= TOL
    assert rec["teachers"]["h"]["prompt"] == str(template)


# --------------------------------------------------------------------------- shift


def test_shift_delta_is_the_difference_of_two_references(rollouts, tiny_model, tiny_teacher, teacher_lm, student_lm):
    path, recs = rollouts
    got = parse(ok(score("--shift", f"post={tiny_teacher},pre={tiny_model}", "--shift-k", "4", path)).stdout_bytes)
    worst = pre_vs_rollout = 0.0
    for rec, src in zip(got, recs, strict=True):
        assert "teachers" not in rec
        shift = rec["shift"]
        assert set(shift) == {"post", "pre", "k", "ids", "delta"}
        assert (shift["post"], shift["pre"], shift["k"]) == (str(tiny_teacher), str(tiny_model), 4)
        np.testing.assert_array_equal(shift["ids"], src["topk_ids"][:, :4])
        post = at(reference(teacher_lm, src["prompt_ids"], src["response_ids"]), shift["ids"])
        pre = at(reference(student_lm, src["prompt_ids"], src["response_ids"]), shift["ids"])
        assert shift["delta"].shape == (len(src["response_ids"]), 4)
        worst = max(worst, max_diff(shift["delta"], post - pre))
        pre_vs_rollout = max(pre_vs_rollout, max_diff(pre, src["topk_logprobs"][:, :4]))
    assert worst <= TOL
    assert pre_vs_rollout <= TOL  # pre is the student: its log-probs at its own top-4 are the rollout's


# --------------------------------------------------------------------------- templates


def test_opsd_template_renders_the_documented_text(rollouts):
    _, recs = rollouts
    example = recs[0]["example"]
    text = load("opsd").render(example, "record 1")
    assert text == TEACHER.format(problem=example["problem"], solution=example["solution"], transition=TRANSITION)
    assert "step \u2014 do not copy" in text and text.endswith("within \\boxed{}.")
    assert load("student").render(example, "record 1") == STUDENT.format(problem=example["problem"])


def test_templates_lists_the_bundled_templates():
    out = subprocess.run([str(BIN / "opd-score"), "templates"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"opsd\tformat\tfields: problem, solution\t{bundled_dir() / 'opsd.fmt'}",
        f"student\tformat\tfields: problem\t{bundled_dir() / 'student.fmt'}",
    ]


# --------------------------------------------------------------------------- errors


def _build_teacher(out: Path, **tokenizer_kwargs) -> Path:
    from opd_common.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer(**tokenizer_kwargs)
    build_model(tokenizer, seed=2).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["smaller-vocab", "other-merges"])
def test_a_teacher_with_another_tokenizer_is_refused_under_align_ids(rollouts, tiny_model, tmp_path, kind):
    """--align ids: refused before any record is scored (--align auto scores it over text: test_score_xtok.py).
    'smaller-vocab': BPE trained to 1024 ids on the same text,
    whose ids are a prefix of the student's 2048 (same strings; the student's upper 1024 ids do not
    exist for it). 'other-merges': 2048 ids trained on less text, so most ids mean other strings."""
    path, _ = rollouts
    kwargs = {"vocab_size": 1024} if kind == "smaller-vocab" else {"corpus_rows": 300}
    teacher = _build_teacher(tmp_path / "teacher", **kwargs)
    s_vocab, t_vocab = load_tokenizer(tiny_model).get_vocab(), load_tokenizer(teacher).get_vocab()
    s_by_id = {i: tok for tok, i in s_vocab.items()}
    if kind == "smaller-vocab":
        assert all(s_by_id[i] == tok for tok, i in t_vocab.items())  # a prefix: no id means another string
        differ = len(s_vocab) - len(t_vocab)
    else:
        assert len(s_vocab) == len(t_vocab)
        differ = sum(s_by_id[i] != tok for tok, i in t_vocab.items())
        assert differ > len(t_vocab) // 2  # measured 1768 of 2048
    err = error_of(score("--teacher", f"x={teacher}", "--align", "ids", path))
    assert err == (
        f"Error: --teacher x={teacher}: its tokenizer differs from the student's ({tiny_model}): {differ} token ids "
        f"map to other strings or exist in only one of them (vocab sizes {len(s_vocab)} vs {len(t_vocab)}); "
        "--align ids needs the student's tokenizer; --align auto scores such a teacher over text chunks\n")


def test_record_errors_name_the_record_and_field(rollouts, tiny_teacher, tiny_model, tmp_path):
    path, recs = rollouts
    no_solution = write_records(tmp_path / "no_solution.jsonl",
                                [dict(recs[0], example={k: v for k, v in recs[0]["example"].items()
                                                        if k != "solution"})])
    fields = ", ".join(sorted(k for k in recs[0]["example"] if k != "solution"))
    assert error_of(score("--teacher", f"t={tiny_teacher}", "--teacher-prompt", "opsd", no_solution)) == (
        f"Error: record 1 of no_solution.jsonl: example has no 'solution' field, which --teacher-prompt opsd needs "
        f"(fields present: {fields})\n")

    no_topk = write_records(tmp_path / "no_topk.jsonl", [{k: v for k, v in rec.items() if not k.startswith("topk_")}
                                                         for rec in recs])
    assert error_of(score("--teacher", f"t={tiny_teacher}", "--at-student-topk", no_topk)) == (
        "Error: record 1 of no_topk.jsonl: --at-student-topk needs the student's top-k ids but the record has 0; "
        "run opd-rollout with --topk-logprobs k\n")

    assert error_of(score("--shift", f"post={tiny_teacher},pre={tiny_model}", "--shift-k", "16", path)) == (
        "Error: record 1 of rollouts.jsonl: --shift needs the student's top-16 ids but the record has 8; "
        "run opd-rollout with --topk-logprobs 16\n")


@pytest.mark.parametrize("args, expected", [
    ([], "nothing to score: give --teacher NAME=MODEL, --shift post=M,pre=M or --reward math"),
    (["--teacher", "tiny"], "--teacher 'tiny': expected NAME=MODEL[@REVISION][+ADAPTER]"),
    (["--engine", "vllm", "--shift", "post=a,pre=b"],
     "--engine vllm scores only the sampled tokens and the teacher's own top-k (prompt_logprobs); "
     "--at-student-topk and --shift need --engine hf"),
    (["--engine", "vllm", "--teacher", "t=a", "--at-student-topk"],
     "--engine vllm scores only the sampled tokens and the teacher's own top-k (prompt_logprobs); "
     "--at-student-topk and --shift need --engine hf"),
    (["--teacher", "t=a", "--topk", "4", "--at-student-topk"],
     "--topk and --at-student-topk are exclusive (own top-k or the student's ids)"),
    (["--shift", "post=a"], "--shift 'post=a': expected post=MODEL,pre=MODEL"),
    (["--teacher", "t=a", "--reward-scale", "pm1"],
     "--reward-scale pm1 goes with --reward math (it scales the verifier's reward)"),
], ids=["nothing", "no-equals", "vllm-shift", "vllm-at-student", "topk-exclusive", "shift-half", "scale-no-reward"])
def test_flag_errors(rollouts, args, expected):
    path, _ = rollouts
    assert error_of(score(*args, path)) == f"Error: {expected}\n"


# --------------------------------------------------------------------------- records and streams


def test_records_unchanged_in_order_across_windows_and_batches(rollouts, tiny_teacher, teacher_lm, tmp_path):
    """Input interleaved so each window of 2 mixes prompt lengths (sorted inside, batched with right
    padding under --token-budget 520): out come the input records, in input order, plus the block."""
    _, recs = rollouts
    order = [0, 2, 4, 1, 3, 5]
    path = write_records(tmp_path / "mixed.jsonl", [recs[i] for i in order])
    lines_in = Path(path).read_bytes().splitlines()
    result = ok(score("--teacher", f"t={tiny_teacher}", "--window", "2", "--token-budget", "520", path))
    lines_out = result.stdout_bytes.splitlines()
    assert len(lines_out) == 6
    for line_in, line_out, i in zip(lines_in, lines_out, order, strict=True):
        raw_in, raw_out = orjson.loads(line_in), orjson.loads(line_out)
        assert raw_out["id"] == recs[i]["id"]
        assert set(raw_out.pop("teachers")) == {"t"}
        assert raw_out == raw_in  # every other field byte for byte (packed arrays included)
    worst = 0.0
    for rec in parse(result.stdout_bytes):
        expected = at(reference(teacher_lm, rec["prompt_ids"], rec["response_ids"]), rec["response_ids"])
        worst = max(worst, max_diff(rec["teachers"]["t"]["logprobs"], expected))
    assert worst <= TOL


@pytest.mark.slow  # three console scripts in a real pipe: ~10 s of interpreter and torch start-up
def test_pipeline_rollout_score_cat_summary(rollouts, scored, tiny_model, tiny_teacher):
    rollout_cmd = " ".join([str(BIN / "opd-rollout"), "--model", str(tiny_model), "--engine", "hf", "--quiet",
                            *ROLLOUT_ARGS])
    score_cmd = f"{BIN / 'opd-score'} --quiet --teacher t={tiny_teacher} --topk 5"
    proc = subprocess.run(f"set -o pipefail; {rollout_cmd} | {score_cmd} | {BIN / 'opd-cat'} --summary", shell=True,
                          executable="/bin/bash", capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    summary = json.loads(proc.stdout)
    tokens = sum(len(r["response_ids"]) for r in scored)
    assert summary["records"] == 6 and summary["response_tokens"] == tokens
    assert set(summary["teachers"]) == {"t"}
    teacher = summary["teachers"]["t"]
    assert (teacher["records"], teacher["tokens"]) == (6, tokens)
    expected_mean = float(np.concatenate([r["teachers"]["t"]["logprobs"] for r in scored]).astype(np.float64).mean())
    assert abs(teacher["mean_logprob"] - expected_mean) <= TOL


@pytest.mark.slow  # real subprocesses: ~5-10 s of interpreter and torch start-up each
def test_the_next_window_is_scored_while_the_reader_has_not_read_the_last(tiny_model, tiny_teacher, tmp_path):
    """Scored windows go out in a writer thread: a window several times a pipe's buffer that the next stage does
    not read yet (a trainer in its step) does not hold back the next window's scoring (OPD_TIMELINE); once read,
    the stream is byte for byte the one a ready reader gets."""
    from opd_common.timeline import read

    records = tmp_path / "rollouts.jsonl"
    records.write_bytes(subprocess.run(
        [str(BIN / "opd-rollout"), "--model", str(tiny_model), "--engine", "hf", "--quiet", "--batch-prompts", "8",
         "-n", "4", "--max-tokens", "64", "--topk-logprobs", "20", "--limit", "24", "aime24"],
        capture_output=True, check=True, timeout=300).stdout)
    cmd = [str(BIN / "opd-score"), "--quiet", "--teacher", f"t={tiny_teacher}", "--topk", "20", "--window", "32",
           str(records)]
    reference = subprocess.run(cmd, capture_output=True, check=True, timeout=300).stdout
    assert len(reference) > 3 * 4 * 65536  # each of the 3 windows is > 4 pipe buffers: its write blocks
    timeline = tmp_path / "timeline"

    def spans(name: str) -> list:
        return [s for s in (read(timeline) if timeline.exists() else []) if s["name"] == name]

    scored_unread, out = read_after(cmd, timeline, lambda: len(spans("score")) >= 2)
    assert scored_unread, "window 2 was not scored while window 1 waited in the pipe"
    assert spans("score")[1]["end"] < spans("write")[0]["end"]
    assert out == reference


@pytest.mark.slow  # a real subprocess: ~5 s of interpreter and torch start-up
def test_stdin_is_scored_record_by_record(rollouts, tiny_teacher, tmp_path):
    """A scored record comes out for each record fed while stdin is still open (windows hand over
    what has arrived when the pipe pauses)."""
    _, recs = rollouts
    cmd = [str(BIN / "opd-score"), "--quiet", "--teacher", f"t={tiny_teacher}", "-"]
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        try:
            lines = _line_reader(proc.stdout)
            for rec in recs[:2]:
                proc.stdin.write(encode(rec))
                proc.stdin.flush()
                line = lines.get(timeout=120)  # stdin stays open: only streaming can produce this
                assert line is not None, (tmp_path / "stderr").read_text()
                (got,) = parse(line)
                assert got["id"] == rec["id"] and set(got["teachers"]) == {"t"}
            proc.stdin.close()
            assert proc.wait(timeout=60) == 0, (tmp_path / "stderr").read_text()
            assert lines.get(timeout=5) is None
        finally:
            proc.kill()


# --------------------------------------------------------------------------- sharded output and resume


def _dir_records(out: Path) -> list[bytes]:
    return [encode(rec) for rec, _ in iter_inputs([str(out)])]


def test_sharded_output_and_exact_resume(rollouts, tiny_teacher, tmp_path, monkeypatch):
    """An interrupted --out run (Ctrl-C while scoring record 5) resumed with --resume gives exactly
    the records of an uninterrupted run. --token-budget 1 scores each record alone, so the numbers
    do not depend on which records share a window: the shards must match byte for byte."""
    from opd_score.scorer import Scorer

    path, recs = rollouts
    args = ["--teacher", f"t={tiny_teacher}", "--window", "2", "--token-budget", "1", "--shard-size", "3", path]
    ref = tmp_path / "ref"
    ok(score(*args, "--out", str(ref)))
    manifest = json.loads((ref / MANIFEST).read_text())
    assert sorted(p.name for p in ref.iterdir()) == [MANIFEST, "scored-00000.jsonl.zst", "scored-00001.jsonl.zst"]
    assert manifest["tool"] == "opd-score" and manifest["records"] == 6
    assert [(s["file"], s["records"]) for s in manifest["shards"]] == [("scored-00000.jsonl.zst", 3),
                                                                        ("scored-00001.jsonl.zst", 3)]
    assert all(s["sha256"] == sha256_file(ref / s["file"]) for s in manifest["shards"])
    assert manifest["config"]["teacher"] == [f"t={tiny_teacher}"]
    assert manifest["inputs"] == [{"input": path, "kind": "file", "sha256": sha256_file(Path(path))}]
    reference_records = _dir_records(ref)
    assert [orjson.loads(r)["id"] for r in reference_records] == [r["id"] for r in recs]

    # interrupted: Ctrl-C when the window holding record 5 is scored (after 3 or 4 records were written)
    original = Scorer.score
    scored_ids: list[str] = []

    def interrupted(self, window):
        if any(rec["id"] == recs[4]["id"] for rec, _ in window):
            raise KeyboardInterrupt
        scored_ids.extend(rec["id"] for rec, _ in window)
        return original(self, window)

    out = tmp_path / "out"
    monkeypatch.setattr(Scorer, "score", interrupted)
    result = score(*args, "--out", str(out))
    assert result.exit_code == 1 and result.stderr == "\nAborted!\n"  # click's answer to Ctrl-C
    assert not (out / MANIFEST).exists()
    progress = json.loads((out / PROGRESS).read_text())
    assert [(s["file"], s["records"]) for s in progress["shards"]] == [("scored-00000.jsonl.zst", 3)]
    assert {p.name for p in out.iterdir()} <= {PROGRESS, "scored-00000.jsonl.zst", "scored-00001.jsonl.zst.tmp"}

    # other options are refused, and the refusal leaves the interrupted run as it was
    assert error_of(score(*args, "--topk", "2", "--out", str(out), "--resume")) == (
        "Error: --resume: the options differ from the interrupted run's (topk); "
        "rerun with the same options, or --overwrite to start again\n")
    assert (out / PROGRESS).exists()

    # resume: only the records after the finished shard are scored
    scored_ids.clear()
    monkeypatch.setattr(Scorer, "score", lambda self, window: (scored_ids.extend(r["id"] for r, _ in window),
                                                               original(self, window))[1])
    ok(score(*args, "--out", str(out), "--resume"))
    assert scored_ids == [r["id"] for r in recs[3:]]
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "scored-00000.jsonl.zst", "scored-00001.jsonl.zst"]
    assert _dir_records(out) == reference_records  # nothing lost, nothing twice, same bytes
    resumed = json.loads((out / MANIFEST).read_text())
    assert [(s["file"], s["records"], s["sha256"]) for s in resumed["shards"]] == \
           [(s["file"], s["records"], s["sha256"]) for s in manifest["shards"]]
    assert resumed["records"] == 6

    assert error_of(score(*args, "--out", str(out), "--resume")) == (
        f"Error: --out {out} is already complete (manifest.json); nothing to resume\n")


# --------------------------------------------------------------------------- verifier rewards

# Hand-made responses on real rollout records (aime24-I-1, gold answer "204"): (text, finish_reason,
# correct, format_ok, reason, extracted). The grader itself has its own table in test_grading.py; here
# the point is the record plumbing: gold from example.answer, finish reason, length, the block's fields.
REWARD_CASES = [
    ("so \\boxed{204}", "stop", 1, True, "match", "204"),
    ("so \\boxed{205}", "stop", 0, True, "mismatch", "205"),
    ("we get 204 in the end", "stop", 0, False, "no-answer", None),
    ("Answer: 0204", "stop", 1, True, "match", "0204"),  # the answer-line style, a leading zero
    ("so \\boxed{204}", "length", 1, True, "match", "204"),
]


@pytest.fixture(scope="module")
def reward_records(rollouts, tmp_path_factory):
    _, recs = rollouts
    rec = recs[0]
    assert rec["example"]["answer"] == "204"
    crafted = [dict(rec, id=f"{rec['prompt_id']}:{i}", sample=i, response_text=text, finish_reason=finish)
               for i, (text, finish, *_) in enumerate(REWARD_CASES)]
    return write_records(tmp_path_factory.mktemp("reward") / "crafted.jsonl", crafted), crafted


def test_reward_math_grades_against_the_examples_answer(reward_records):
    path, crafted = reward_records
    got = parse(ok(score("--reward", "math", "--grade-workers", "1", path)).stdout_bytes)
    assert [r["id"] for r in got] == [r["id"] for r in crafted]
    for rec, (text, finish, correct, format_ok, reason, extracted) in zip(got, REWARD_CASES, strict=True):
        block = rec["reward"]
        assert set(block) == {"correct", "format_ok", "stop_ok", "length_penalty", "total", "verifier", "extracted",
                              "reason", "scale"}
        assert block["scale"] == "01"  # the default: right 1, wrong 0
        assert (block["correct"], block["format_ok"], block["stop_ok"], block["reason"], block["verifier"]) == \
               (correct, format_ok, finish == "stop", reason, "math"), text
        assert block["extracted"] == extracted, text
        assert (block["length_penalty"], block["total"]) == (0.0, float(correct)), text
        assert "teachers" not in rec and "shift" not in rec


def test_reward_require_stop_and_overlong_penalty(reward_records):
    """--require-stop: a truncated ('length') response earns nothing even when its box is right.
    --max-response-tokens 8 --overlong-buffer 4: penalty (8 - 4 - len) / 4 past 4 tokens."""
    path, crafted = reward_records
    n = len(crafted[0]["response_ids"])
    assert 4 < n <= 8  # inside the soft buffer (measured 6 tokens): a penalty strictly between -1 and 0
    penalty = (8 - 4 - n) / 4
    got = parse(ok(score("--reward", "math", "--grade-workers", "1", "--require-stop", "--max-response-tokens", "8",
                         "--overlong-buffer", "4", path)).stdout_bytes)
    for rec, (text, finish, correct, *_) in zip(got, REWARD_CASES, strict=True):
        block = rec["reward"]
        assert block["correct"] == correct, text  # the verdict itself ignores the finish reason
        assert block["length_penalty"] == pytest.approx(penalty, abs=1e-12)
        earned = 1.0 if correct and finish == "stop" else 0.0
        assert block["total"] == pytest.approx(earned + penalty, abs=1e-12), text
    assert got[-1]["reward"]["total"] == pytest.approx(penalty)  # boxed 204, but truncated


def cut(rec: dict, length: int) -> dict:
    """The record with its response (and every per-token array) cut to `length` tokens."""
    n = len(rec["response_ids"])
    return {k: (v[:length] if isinstance(v, np.ndarray) and k != "prompt_ids" and len(v) == n else v)
            for k, v in rec.items()}


# A DAPO group of 4 (one prompt, gold 204): (text, response tokens). --max-response-tokens 7 --overlong-buffer 4:
# no penalty up to 3 tokens, (3 - len) / 4 beyond, so the long right answer gets -0.75.
GROUP = [("so \\boxed{204}", 3), ("so \\boxed{204}", 6), ("so \\boxed{205}", 3), ("we get 7", 3)]


@pytest.mark.parametrize("scale, totals", [
    ("01", [1.0, 0.25, 0.0, 0.0]),  # accuracy 1 / 0, plus the penalty
    ("pm1", [1.0, 0.25, -1.0, -1.0]),  # DAPO: 2 * correct - 1, plus the penalty
])
def test_reward_scale_and_the_group_advantages_of_an_overlong_sample(reward_records, tmp_path, scale, totals):
    """--reward-scale: reward.total of a group with a right answer in the overlong buffer, recorded as
    reward.scale, and the group advantages opd-train computes from it. With 01 the penalty weighs as much as
    correctness and the long right answer falls below the group mean (advantage < 0); with DAPO's +1/-1 it
    stays above the wrong ones and the mean (advantage > 0)."""
    import torch

    from opd_train.losses import group_advantages

    _, crafted = reward_records
    assert len(crafted[0]["response_ids"]) >= 6
    group = [cut(dict(crafted[0], id=f"g:{i}", sample=i, group_size=4, response_text=text), n)
             for i, (text, n) in enumerate(GROUP)]
    path = write_records(tmp_path / "group.jsonl", group)
    got = parse(ok(score("--reward", "math", "--grade-workers", "1", "--require-stop", "--max-response-tokens", "7",
                         "--overlong-buffer", "4", "--reward-scale", scale, path)).stdout_bytes)
    blocks = [rec["reward"] for rec in got]
    assert [b["correct"] for b in blocks] == [1, 1, 0, 0] and [b["scale"] for b in blocks] == [scale] * 4
    assert [b["length_penalty"] for b in blocks] == [0.0, -0.75, 0.0, 0.0]
    assert [b["total"] for b in blocks] == pytest.approx(totals, abs=1e-12)
    mean = sum(totals) / 4  # the advantages by hand: (R - mean) / (unbiased std + 1e-6)
    std = (sum((r - mean) ** 2 for r in totals) / 3) ** 0.5
    want = [(r - mean) / (std + 1e-6) for r in totals]
    adv = group_advantages(torch.tensor([b["total"] for b in blocks], dtype=torch.float64)).tolist()
    assert adv == pytest.approx(want, abs=1e-6)
    assert want == pytest.approx({"01": [1.4527, -0.1321, -0.6603, -0.6603],
                                  "pm1": [1.2033, 0.4433, -0.8233, -0.8233]}[scale], abs=1e-4)
    assert (adv[1] > 0) == (scale == "pm1")  # the scale decides whether the long right answer is reinforced


def test_reward_without_answer_names_the_record(rollouts, tmp_path):
    _, recs = rollouts
    path = write_records(tmp_path / "no_answer.jsonl",
                         [recs[0], dict(recs[1], example={k: v for k, v in recs[1]["example"].items()
                                                          if k != "answer"})])
    result = score("--reward", "math", "--grade-workers", "1", "--window", "1", path)
    assert result.exit_code == 1
    assert [r["id"] for r in parse(result.stdout_bytes)] == [recs[0]["id"]]  # the record before it came out
    assert result.stderr == ("Error: record 2 of no_answer.jsonl: example has no 'answer' field, "
                             "which --reward math grades against\n")


# --------------------------------------------------------------------------- data parallel


@pytest.mark.slow  # two spawned worker processes load torch and the teacher: ~15 s
def test_data_parallel_gives_the_same_records_in_the_same_order(rollouts, tiny_teacher, tiny_model, tmp_path):
    """--data-parallel 2: windows of one record alternate between two worker processes, yet the
    output is the single-process output: same records, same order, same ids and rewards, and
    log-probs equal to float tolerance (a worker gets half the CPU threads, so matmul sums may
    round differently)."""
    path, recs = rollouts
    args = ["--teacher", f"t={tiny_teacher}", "--shift", f"post={tiny_teacher},pre={tiny_model}", "--shift-k", "4",
            "--reward", "math", "--window", "1", "--token-budget", "1", path]
    single = ok(score(*args)).stdout_bytes
    parallel = ok(score(*args, "--data-parallel", "2")).stdout_bytes
    one, two = parse(single), parse(parallel)
    assert [r["id"] for r in two] == [r["id"] for r in recs]
    for a, b in zip(one, two, strict=True):
        assert max_diff(a["teachers"]["t"]["logprobs"], b["teachers"]["t"]["logprobs"]) <= TOL
        assert np.array_equal(a["shift"]["ids"], b["shift"]["ids"])
        assert max_diff(a["shift"]["delta"], b["shift"]["delta"]) <= TOL
        assert a["reward"] == b["reward"]
        for rec in (a, b):
            del rec["teachers"], rec["shift"]
        assert orjson.dumps(a, option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(b, option=orjson.OPT_SERIALIZE_NUMPY)


@pytest.mark.slow  # a real subprocess with two spawned workers: ~15 s of interpreter and torch start-up
def test_data_parallel_workers_end_with_the_parent_when_the_reader_goes(rollouts, tiny_teacher, tmp_path):
    """`opd-score --data-parallel 2 | head -1`: the parent leaves at once when its reader has gone (os._exit,
    which runs no finally block), and its workers, each holding its teachers (a GPU's memory), go with it
    instead of waiting for windows forever."""
    import os
    import time
    import uuid

    path, _ = rollouts
    many = tmp_path / "many.jsonl"
    many.write_bytes(Path(path).read_bytes() * 40)  # 240 windows of one record: far more than the reader takes
    mark = f"OPD_TEST_MARK={uuid.uuid4().hex}"

    def marked() -> list[int]:  # processes whose environment carries `mark`: the parent and its children
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if mark.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(int(pid))
            except OSError:
                pass
        return found

    proc = subprocess.Popen([str(BIN / "opd-score"), "--quiet", "--teacher", f"t={tiny_teacher}", "--window", "1",
                             "--data-parallel", "2", str(many)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, mark.split("=")[0]: mark.split("=")[1]})
    try:
        assert json.loads(proc.stdout.readline())["id"]
        assert len(marked()) >= 3, "expected the parent and two workers (and multiprocessing's resource tracker)"
        proc.stdout.close()  # the reader goes: the parent's next write fails
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
        deadline = time.monotonic() + 20
        while marked() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marked() == [], "a scoring worker outlived its parent"
    finally:
        for pid in [proc.pid, *marked()]:
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def test_data_parallel_worker_errors_reach_the_user(rollouts, tiny_teacher, tmp_path):
    """A record error inside a worker is reported like a single-process one, naming the record. The window before
    it, scored by the other worker, comes out whole when its result reaches the parent before the error does (as
    in one process: test_reward_without_answer_names_the_record), and not at all otherwise: a race, both fine."""
    _, recs = rollouts
    broken = [dict(r) for r in recs[:2]]
    broken[1]["example"] = {k: v for k, v in broken[1]["example"].items() if k != "answer"}
    path = write_records(tmp_path / "broken.jsonl", broken)
    result = score("--reward", "math", "--window", "1", "--data-parallel", "2", path)
    assert result.exit_code == 1
    assert [r["id"] for r in parse(result.stdout_bytes)] in ([], [recs[0]["id"]])
    assert "record 2 of" in result.stderr and "no 'answer' field" in result.stderr


def _silent_exit() -> None:  # a worker that ends without a word
    pass


def _killed() -> None:  # a worker the kernel kills (out of memory, say)
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _counts_then_exit(results, rank: int) -> None:
    results.put(("counts", rank, {"t": rank}))


def test_data_parallel_parent_names_a_worker_gone_without_its_results():
    """The parent's reader of worker messages (opd_score.parallel._messages), with real processes: a
    worker gone before the parent's stop message is an error even with exit code 0 (its window would
    never come back: a hang, otherwise); after it, workers that send their counts and exit are read to the
    end, and a worker killed by a signal is named by its exit code."""
    import multiprocessing as mp

    from opd_score.parallel import _messages

    ctx = mp.get_context("fork")
    stop = threading.Event()
    stop.set()

    def started(*procs):
        for p in procs:
            p.start()
            p.join()
        return list(procs)

    silent = started(ctx.Process(target=_silent_exit, name="opd-score-worker-0"))
    with pytest.raises(RuntimeError, match=r"scoring worker opd-score-worker-0 died \(exit code 0\)"):
        for _ in _messages(ctx.Queue(), silent, threading.Event()):
            pass

    results = ctx.Queue()
    done = started(*[ctx.Process(target=_counts_then_exit, args=(results, r)) for r in range(2)])
    messages = _messages(results, done, stop)
    got = list(itertools.islice(filter(None, messages), 2))
    assert sorted(got, key=str) == [("counts", {"t": 0}), ("counts", {"t": 1})]
    with pytest.raises(RuntimeError, match="every scoring worker exited before sending its alignment counts"):
        for _ in messages:
            pass

    killed = started(ctx.Process(target=_killed, name="opd-score-worker-1"))
    with pytest.raises(RuntimeError, match=r"opd-score-worker-1 died \(exit code -9\)"):
        for _ in _messages(ctx.Queue(), killed, stop):
            pass


def test_data_parallel_worker_error_that_cannot_be_pickled_still_reaches_the_parent():
    """mp.Queue pickles in a background thread and drops what it cannot pickle without a word: a worker's
    error holding a lock would vanish (the parent would only see a worker gone). It crosses as its traceback."""
    import pickle

    from opd_score.parallel import _picklable

    class Holding(Exception):
        def __init__(self):
            super().__init__("teacher failed")
            self.lock = threading.Lock()

    try:
        raise Holding()
    except Holding as exc:
        sent = pickle.loads(pickle.dumps(_picklable(exc)))
    assert isinstance(sent, RuntimeError)
    assert "Holding: teacher failed" in str(sent) and "raise Holding()" in str(sent)
    plain = ValueError("record 2: no 'answer' field")
    assert _picklable(plain) is plain
