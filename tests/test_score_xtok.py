"""opd-score with a teacher whose tokenizer differs from the student's (issue 20), and what reads its records:
teachers.NAME.text against a reference forward of the teacher, the exact reduction to rkl with the student's
own tokenizer, opd-train --loss rkl / uld on such records, opd-cat's chunks and the record checks.

Student: the tiny plain BPE (tests/conftest.py tiny_model). Teacher with another tokenizer: a tiny model on
the digit-splitting BPE. Records are built by hand from chosen texts (a random student's samples are mostly
bytes that are not UTF-8 text), one of them cut mid-character and one not valid UTF-8."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_rollout import load_model, load_tokenizer, ok, parse
from test_score import TOL, error_of, score, write_records

from opd_common.models import render_chat
from opd_common.records import SCHEMA, Where, validate
from opd_train import losses as L
from opd_train.config import TrainConfig
from opd_train.data import collate, make_example

TEXTS = ["12345 + 678 = 13023", "café ∑ x² naïve\n\n  ok", "ab 😀"]


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory) -> Path:
    from opd_common.tiny import build_model, build_tokenizer

    out = tmp_path_factory.mktemp("xtok") / "teacher"
    tokenizer = build_tokenizer(split_digits=True)
    build_model(tokenizer, seed=3).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _record(tok, model: Path, i: int, response_ids: list[int], finish: str) -> dict:
    gen = np.random.default_rng(i)
    return {"schema": SCHEMA, "id": f"p{i}:0", "prompt_id": f"p{i}", "sample": 0, "group_size": 1,
            "example": {"problem": f"problem {i} = ?", "answer": "1"},
            "policy": {"model": str(model), "revision": None, "adapter": None, "version": 0},
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 32, "seed": i, "engine": "hf",
                         "logprobs": "raw", "thinking": False},
            "prompt_ids": render_chat(tok, f"problem {i} = ?", False), "response_ids": response_ids,
            "finish_reason": finish, "logprobs": (-gen.random(len(response_ids)) * 4).tolist()}


@pytest.fixture(scope="module")
def records(tiny_model, tmp_path_factory) -> Path:
    """TEXTS + EOS; the emoji text cut after 2 of its byte tokens (finish 'length'); one response whose first
    token is a lone UTF-8 lead byte (not text)."""
    tok = load_tokenizer(tiny_model)
    recs = [_record(tok, tiny_model, i, tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], "stop")
            for i, t in enumerate(TEXTS[:2])]
    emoji = tok(TEXTS[2], add_special_tokens=False)["input_ids"]
    cut = len(tok("ab ", add_special_tokens=False)["input_ids"]) + 2
    recs.append(_record(tok, tiny_model, 2, emoji[:cut], "length"))
    recs.append(_record(tok, tiny_model, 3, [tok.convert_tokens_to_ids("Ã")] + tok("5")["input_ids"], "length"))
    return Path(write_records(tmp_path_factory.mktemp("xtok") / "records.jsonl", recs))


def _reference(model: Path, context: list[int], ids: list[int]) -> np.ndarray:
    lm = load_model(model)
    seq = torch.tensor([context + ids])
    with torch.no_grad():
        logp = torch.log_softmax(lm(seq).logits[0].float(), -1)
    P = len(context)
    return logp[torch.arange(P - 1, P - 1 + len(ids)), torch.tensor(ids)].numpy()


def test_a_teacher_with_another_tokenizer_scores_the_text(records, tiny_model, other_teacher, caplog):
    result = ok(score("--teacher", f"x={other_teacher}", "--topk", "4", str(records)))
    recs = parse(result.stdout_bytes)
    s_tok, t_tok = load_tokenizer(tiny_model), load_tokenizer(other_teacher)
    assert [r["teachers"]["x"]["text"]["status"] for r in recs] == ["ok", "ok", "partial", "refused"]
    assert caplog.messages[-1] == (
        "teacher x (another tokenizer): 4 records aligned over text, 1 refused, 1 partial; 4 of "
        f"{sum(len(r['response_ids']) for r in recs)} student tokens in no chunk (they get no teacher signal); "
        "1 x N trailing student tokens are in no chunk; 1 x the student's tokens are not valid UTF-8")
    for rec, text in zip(recs[:3], [*TEXTS[:2], "ab "], strict=True):
        block = rec["teachers"]["x"]["text"]
        assert block["format"] == "opd-text/1" and block["text"] == text
        eos = [t_tok.eos_token_id] if rec["finish_reason"] == "stop" else []
        assert block["ids"].tolist() == t_tok(text, add_special_tokens=False)["input_ids"] + eos
        # as-is: the student's prompt text, tokenized by the teacher
        context = t_tok(s_tok.decode(rec["prompt_ids"].tolist()), add_special_tokens=False)["input_ids"]
        want = _reference(other_teacher, context, block["ids"].tolist())
        assert np.abs(block["logprobs"] - want).max() < TOL
        starts = [0, *block["teacher_end"].tolist()[:-1]]
        sums = [want[a:b].sum() for a, b in zip(starts, block["teacher_end"].tolist(), strict=True)]
        assert np.abs(block["chunk_logprobs"] - np.array(sums)).max() < TOL
        assert block["topk_ids"].shape == (len(block["ids"]), 4) and block["topk_logprobs"].shape[1] == 4
    assert recs[3]["teachers"]["x"]["text"]["ids"].tolist() == [] and "logprobs" not in recs[3]["teachers"]["x"]


def test_a_template_renders_the_teachers_own_chat_template(records, other_teacher, tmp_path):
    fmt = tmp_path / "t.fmt"
    fmt.write_text("Solve: {problem}")
    rec = parse(ok(score("--teacher", f"x={other_teacher}", "--teacher-prompt", str(fmt), "--teacher-thinking", "off",
                         str(records))).stdout_bytes)[0]
    t_tok = load_tokenizer(other_teacher)
    context = render_chat(t_tok, "Solve: problem 0 = ?", False)
    block = rec["teachers"]["x"]["text"]
    assert np.abs(block["logprobs"] - _reference(other_teacher, context, block["ids"].tolist())).max() < TOL


def _config(**kw) -> TrainConfig:
    return TrainConfig(model="unused", out="unused", loss="rkl", max_steps=1, batch_size=1, **kw)


@pytest.mark.parametrize("discount", [0.0, 0.5])
def test_exact_reduction_same_tokenizer_same_rkl_loss_and_gradients(records, tiny_teacher, discount):
    """With the student's own tokenizer, --align text gives one-token chunks, chunk log-probs equal to the token
    log-probs of --align ids, and rkl over chunks the same advantages, loss and gradients as rkl over tokens."""
    by_ids = parse(ok(score("--teacher", f"t={tiny_teacher}", str(records))).stdout_bytes)
    by_text = parse(ok(score("--teacher", f"t={tiny_teacher}", "--align", "text", str(records))).stdout_bytes)
    cfg = _config(discount=discount)
    for a, b in zip(by_ids, by_text, strict=True):
        text = b["teachers"]["t"]["text"]
        T = len(a["response_ids"])
        assert text["student_end"].tolist() == text["teacher_end"].tolist() == list(range(1, T + 1))
        assert np.array_equal(text["chunk_logprobs"], a["teachers"]["t"]["logprobs"])
        ex_a, ex_b = (make_example(r, Where("r", 1), cfg) for r in (a, b))
        assert np.array_equal(ex_a.tokens["advantage"], ex_b.tokens["advantage"])
        chunks = [collate([ex]) for ex in (ex_a, ex_b)]
        grads, outs = [], []
        for chunk in chunks:
            logits = torch.randn(T, 2048, generator=torch.Generator().manual_seed(0), requires_grad=True)
            out = L.rkl(logits, chunk["targets_N"], chunk["behaviour_logp"], chunk["advantage"], 7, ratio_clip=2.0,
                        teacher_logp_N=chunk["teacher_logp"])
            out.loss.backward()
            outs.append(out)
            grads.append(logits.grad)
        assert torch.equal(outs[0].loss, outs[1].loss) and torch.equal(grads[0], grads[1])
        assert torch.allclose(outs[0].metrics["reverse_kl"], outs[1].metrics["reverse_kl"], atol=1e-6)


def test_opd_train_rkl_and_uld_on_text_chunks_and_opd_cat_shows_them(records, tiny_model, other_teacher, tmp_path):
    from opd_common import cat
    from opd_train import cli

    scored = ok(score("--teacher", f"x={other_teacher}", "--topk", "4", str(records))).stdout_bytes
    for loss in ("rkl", "uld"):
        run = tmp_path / loss
        ok(CliRunner().invoke(cli.command, ["--quiet", "--model", str(tiny_model), "--out", str(run), "--lr", "1e-3",
                                            "--lora-r", "4", "--lora-alpha", "8", "--loss", loss, "--max-steps", "1",
                                            "--batch-size", "4"], input=scored))
        row = json.loads((run / "metrics.jsonl").read_text())
        assert np.isfinite(row["loss"]) and row["tokens"] == sum(len(r["response_ids"]) for r in parse(scored))
    assert row["uld_positions"] > 0 and row["uld"] > 0
    shown = [json.loads(line) for line in ok(CliRunner().invoke(
        cat.command, ["--decode", "--fields", "teacher_chunks"], input=scored)).stdout.splitlines()]
    s_tok, rec = load_tokenizer(tiny_model), parse(scored)[0]
    chunks = shown[0]["teacher_chunks"]["x"]
    assert "".join(c["text"] for c in chunks) == TEXTS[0]
    text = rec["teachers"]["x"]["text"]
    for c, lp in zip(chunks, text["chunk_logprobs"].tolist(), strict=True):
        a, b = c["student"]
        assert c["teacher_logprob"] == pytest.approx(lp)
        assert c["student_logprob"] == pytest.approx(float(rec["logprobs"][a:b].astype(np.float64).sum()))
        assert c["text"] == s_tok.decode(rec["response_ids"][a:b].tolist(), skip_special_tokens=True)
    assert shown[3]["teacher_chunks"]["x"] == []
    summary = json.loads(ok(CliRunner().invoke(cat.command, ["--summary"], input=scored)).stdout)["teachers"]["x"]
    texts = [r["teachers"]["x"]["text"] for r in parse(scored)]
    assert summary == {"records": 4, "tokens": sum(len(t["logprobs"]) for t in texts), "aligned": {
        "ok": 2, "partial": 1, "refused": 1}, "mean_logprob": pytest.approx(
        float(np.concatenate([t["logprobs"] for t in texts]).astype(np.float64).mean()))}


def test_uld_reads_a_refused_records_empty_top_k_from_plain_json(records, tiny_model, other_teacher, tmp_path):
    """--encoding json writes a refused record's [0][k] top-k as [], which has no width: the block's k gives it."""
    from opd_train import cli

    scored = ok(score("--teacher", f"x={other_teacher}", "--topk", "4", "--encoding", "json", str(records)))
    refused = [json.loads(line)["teachers"]["x"]["text"] for line in scored.stdout_bytes.splitlines()]
    assert [(t["status"], t["topk_ids"], t["k"]) for t in refused if t["status"] == "refused"] == [("refused", [], 4)]
    run = tmp_path / "uld"
    ok(CliRunner().invoke(cli.command, ["--quiet", "--model", str(tiny_model), "--out", str(run), "--lora-r", "4",
                                        "--lora-alpha", "8", "--loss", "uld", "--max-steps", "1", "--batch-size", "4"],
                          input=scored.stdout_bytes))
    assert json.loads((run / "metrics.jsonl").read_text())["uld_positions"] > 0


def test_a_damaged_text_block_is_refused_naming_the_field(records, other_teacher):
    rec = parse(ok(score("--teacher", f"x={other_teacher}", str(records))).stdout_bytes)[0]
    text = rec["teachers"]["x"]["text"]
    text["student_end"] = text["student_end"].copy()
    text["student_end"][-1] = len(rec["response_ids"]) + 1
    with pytest.raises(Exception) as err:
        validate(rec, "record 1 of s.jsonl")
    assert str(err.value) == (f"record 1 of s.jsonl: field 'teachers.x.text.student_end' must increase strictly from "
                              f">= 1 to <= {len(rec['response_ids'])}")
    text["chunk_logprobs"] = text["chunk_logprobs"][:-1]
    with pytest.raises(Exception) as err:
        validate(rec, "record 1 of s.jsonl")
    assert "field 'teachers.x.text.chunk_logprobs' has" in str(err.value)


def test_at_student_topk_refuses_another_tokenizer_in_one_line(records, tiny_model, other_teacher):
    assert error_of(score("--teacher", f"x={other_teacher}", "--at-student-topk", str(records))) == (
        f"Error: --teacher x={other_teacher} has another tokenizer than the student's ({tiny_model}): "
        "--at-student-topk reads the teacher at the student's ids; use --topk K instead\n")


def test_data_parallel_workers_report_one_count_line_per_teacher(records, other_teacher, caplog):
    """--data-parallel 2 with windows of one record: the workers' alignment counts reach the parent, which logs the
    same single line as one process (not one line per worker)."""
    ok(score("--teacher", f"x={other_teacher}", "--topk", "4", str(records)))
    single = [m for m in caplog.messages if m.startswith("teacher x (another tokenizer)")]
    caplog.clear()
    ok(score("--teacher", f"x={other_teacher}", "--topk", "4", "--window", "1", "--data-parallel", "2", str(records)))
    parallel = [m for m in caplog.messages if m.startswith("teacher x (another tokenizer)")]
    assert len(single) == 1 and parallel == single
