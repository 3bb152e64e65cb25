"""opd-cat as a user runs it: --head, --fields, --summary, --decode, errors."""

from __future__ import annotations

import io

import numpy as np
import orjson
import pytest
from click.testing import CliRunner
from test_records import assert_records_equal, make_record

from opd_common.cat import command
from opd_common.streams import ManifestInfo, ShardWriter, StreamWriter, decode_line

VERIFIER = "math-verify"


def reward(correct: bool, format_ok: bool, length_penalty: float) -> dict:
    total = float(correct) + length_penalty
    return {"correct": correct, "format_ok": format_ok, "length_penalty": length_penalty, "total": total,
            "verifier": VERIFIER}


def sample_records() -> list[dict]:
    """Five records in two groups; lengths 2, 4, 6, 8, 10; hand-computed summary in test_summary."""
    lp = lambda *v: {"model": "teach", "prompt": "as-is", "logprobs": np.array(v, np.float32)}  # noqa: E731
    return [
        make_record("p0", 0, range(2), group_size=3, teachers={"t": lp(-1.0, -0.5)},
                    reward=reward(True, True, 0.0)),
        make_record("p0", 1, range(4), group_size=3, finish_reason="length", teachers={"t": lp(*[-0.25] * 4)},
                    reward=reward(False, True, -0.5)),
        make_record("p0", 2, range(6), group_size=3, reward=reward(True, False, 0.0)),
        make_record("p1", 0, range(8), teachers={"t": lp(*[-2.0] * 8), "u": lp(*[-1.0] * 8)}),
        make_record("p1", 1, range(10), finish_reason="length", version=3, reward=reward(False, False, -0.25)),
    ]


def as_stdin(recs: list[dict], compress: bool = False) -> bytes:
    buf = io.BytesIO()
    with StreamWriter(buf, compress=compress) as writer:
        for rec in recs:
            writer.write(rec)
    return buf.getvalue()


def run(args: list[str], input: bytes | None = None):
    return CliRunner().invoke(command, args, input=input, catch_exceptions=False)


def lines(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    return [orjson.loads(line) for line in result.stdout_bytes.splitlines()]


# --------------------------------------------------------------------------- printing


def test_help_opens_with_pipe_examples():
    result = run(["--help"])
    assert result.exit_code == 0
    assert "opd-rollout --model M aime24 | opd-cat --summary" in result.stdout


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zstd"])
def test_records_pass_through_unchanged(compress):
    result = run([], input=as_stdin(sample_records(), compress))
    assert result.exit_code == 0, result.output
    got = [decode_line(line, "out") for line in result.stdout_bytes.splitlines()]
    want = sample_records()
    assert len(got) == 5
    for g, w in zip(got, want, strict=True):
        assert_records_equal(g, w)


def test_head():
    assert [r["id"] for r in lines(run(["--head", "2"], as_stdin(sample_records())))] == ["p0:0", "p0:1"]
    assert lines(run(["--head", "0"], as_stdin(sample_records()))) == []
    assert len(lines(run(["--head", "99"], as_stdin(sample_records())))) == 5


def test_head_stops_reading_before_the_next_record():
    data = as_stdin(sample_records()[:2]) + b"{not json\n"
    assert [r["id"] for r in lines(run(["--head", "2", "--fields", "id"], data))] == ["p0:0", "p0:1"]


def test_negative_head_is_refused():
    result = run(["--head", "-1"], b"")
    assert result.exit_code == 1
    assert result.stderr == "Error: --head must be >= 0, got -1\n"


def test_fields_with_dotted_paths():
    out = lines(run(["--fields", "id, reward.total,teachers.t.model,policy.version,missing.x"],
                    as_stdin(sample_records())))
    assert out[0] == {"id": "p0:0", "reward.total": 1.0, "teachers.t.model": "teach", "policy.version": 0,
                      "missing.x": None}
    assert out[3] == {"id": "p1:0", "reward.total": None, "teachers.t.model": "teach", "policy.version": 0,
                      "missing.x": None}
    assert [r["reward.total"] for r in out] == [1.0, -0.5, 1.0, None, -0.25]


def test_fields_keep_arrays_packed_without_decode():
    (packed,) = lines(run(["--fields", "teachers.t.logprobs"], as_stdin(sample_records()[:1])))
    assert packed == {"teachers.t.logprobs": {"nd": "float32", "shape": [2], "b64": "AACAvwAAAL8="}}  # [-1, -0.5]


def test_reads_files_and_shard_directories(tmp_path):
    recs = sample_records()
    with ShardWriter(tmp_path / "shards", ManifestInfo("opd-test"), shard_size=2) as writer:
        for rec in recs[:3]:
            writer.write(rec)
    path = tmp_path / "rest.jsonl.zst"
    path.write_bytes(as_stdin(recs[3:], compress=True))
    result = run([str(tmp_path / "shards"), str(path), "--fields", "id"])
    assert [r["id"] for r in lines(result)] == ["p0:0", "p0:1", "p0:2", "p1:0", "p1:1"]


def test_invalid_record_is_one_clear_error_line():
    recs = sample_records()[:2]
    del recs[1]["logprobs"]
    result = run([], as_stdin(recs))
    assert result.exit_code == 1
    assert result.stderr == "Error: record 2 of <stdin> has no 'logprobs' (was it written by opd-rollout?)\n"


def test_no_check_passes_foreign_rows_through():
    result = run(["--no-check"], b'{"problem": "1+1?", "answer": "2"}\n')
    assert lines(result) == [{"problem": "1+1?", "answer": "2"}]


def test_missing_input_file_is_named(tmp_path):
    result = run([str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 1
    assert "Error: input '" in result.stderr and "nope.jsonl' does not exist" in result.stderr


# --------------------------------------------------------------------------- --summary


def test_summary_against_hand_computed_values():
    result = run(["--summary"], as_stdin(sample_records()))
    assert result.exit_code == 0, result.output
    summary = orjson.loads(result.stdout_bytes)
    lengths = summary.pop("response_length")
    # lengths 2, 4, 6, 8, 10; numpy's linear quantile: p10 at index 0.4 -> 2.8, p90 at 3.6 -> 9.2
    assert lengths == pytest.approx({"min": 2.0, "p10": 2.8, "p50": 6.0, "p90": 9.2, "max": 10.0, "mean": 6.0})
    teachers = summary.pop("teachers")
    # t: 2 + 4 + 8 = 14 tokens, sum -1.5 - 1.0 - 16.0 = -18.5; u: 8 tokens of -1.0
    assert teachers == {"t": {"records": 3, "tokens": 14, "mean_logprob": pytest.approx(-18.5 / 14)},
                        "u": {"records": 1, "tokens": 8, "mean_logprob": -1.0}}
    assert summary == {
        "records": 5,
        "groups": 2,
        "response_tokens": 30,
        "finish_reason": {"stop": 3, "length": 2},
        "policy_version": {"0": 4, "3": 1},
        "engine": {"hf": 5},
        # 4 records with a reward: correct T F T F, format_ok T T F F, penalties 0 -.5 0 -.25
        "reward": {"records": 4, "mean_correct": 0.5, "mean_format_ok": 0.5,
                   "mean_length_penalty": -0.1875, "mean_total": 0.3125},
    }


def test_summary_with_head_and_shift():
    recs = sample_records()[:2]
    recs[0]["shift"] = {"post": "a", "pre": "b", "k": 1, "ids": [[0], [1]], "delta": [[0.5], [1.5]]}
    recs[1]["shift"] = {"post": "a", "pre": "b", "k": 1, "ids": [[0]] * 4, "delta": [[-1.0]] * 4}
    summary = orjson.loads(run(["--summary", "--head", "2"], as_stdin(recs + sample_records())).stdout_bytes)
    assert (summary["records"], summary["groups"], summary["response_tokens"]) == (2, 1, 6)
    assert summary["shift"] == {"records": 2, "mean_delta": (0.5 + 1.5 - 4.0) / 6}
    assert summary["reward"] == {"records": 2, "mean_correct": 0.5, "mean_format_ok": 1.0,
                                 "mean_length_penalty": -0.25, "mean_total": 0.25}


def test_summary_of_nothing():
    summary = orjson.loads(run(["--summary"], b"").stdout_bytes)
    assert summary == {"records": 0, "groups": 0, "response_tokens": 0, "response_length": {},
                       "finish_reason": {}, "policy_version": {}, "engine": {}}


# --------------------------------------------------------------------------- --decode (tiny tokenizer)

TEMPLATE_PROMPT = "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from opd_common.models import load_tokenizer

    return load_tokenizer(str(tiny_model))


def tiny_record(tiny_model, tokenizer, model: str | None = None) -> dict:
    from opd_common.models import render_chat

    ids = tokenizer("The answer is 42.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rec = make_record("p0", 0, ids, k=2, model=model or str(tiny_model),
                      teachers={"t": {"model": "teach", "logprobs": np.full(len(ids), -0.75, np.float32)}})
    rec["prompt_ids"] = render_chat(tokenizer, "What is 6 * 7?", thinking=False)
    return rec


def test_decode_gives_plain_numbers_and_token_text(tiny_model, tokenizer):
    rec = tiny_record(tiny_model, tokenizer)
    (out,) = lines(run(["--decode"], as_stdin([rec])))
    T = len(rec["response_ids"])
    assert out["response_ids"] == rec["response_ids"].tolist()
    assert out["logprobs"] == [-(t + 1) / 8 for t in range(T)]
    assert out["topk_ids"] == [[i, i + 1] for i in out["response_ids"]]
    assert out["topk_logprobs"] == [[-(t + 1) / 8, -(t + 1) / 8 - 1] for t in range(T)]
    assert out["teachers"]["t"]["logprobs"] == [-0.75] * T
    assert out["prompt_text"] == TEMPLATE_PROMPT
    tokens = out["response_tokens"]
    assert len(tokens) == T and tokens[-1] == "<|im_end|>"
    assert tokenizer.convert_tokens_to_string(tokens[:-1]) == "The answer is 42."
    assert [row[0] for row in out["topk_tokens"]] == tokens


def test_decode_with_tokenizer_flag_overrides_policy_model(tiny_model, tokenizer):
    rec = tiny_record(tiny_model, tokenizer, model="some-org/not-downloaded")
    args = ["--decode", "--tokenizer", str(tiny_model), "--fields", "id,teachers.t.logprobs,response_tokens"]
    (out,) = lines(run(args, as_stdin([rec])))
    assert out["id"] == "p0:0" and out["teachers.t.logprobs"] == [-0.75] * len(rec["response_ids"])
    assert out["response_tokens"][-1] == "<|im_end|>"
