"""Prompt inputs people already have (issue 19): parquet (verl's layout), datasets folders, TRL conversations.

Every file is made here: a JSONL, a verl-format parquet, a TRL conversational dataset saved to disk. The same
prompts give the same prompt_ids through every format, equal to the chat template applied independently.
Bad input is one error line naming the row, the columns seen and the flag. Parquet streams (bounded memory).
"""

from __future__ import annotations

import io
import json
import logging
import random
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_rollout import ok, parse, rollout

from opd_common.prompts import DEFAULT_TEMPLATE, iter_prompt_rows
from opd_common.tables import iter_parquet

PROBLEMS = [("What is 6 * 7?", "42"), ("Compute 2 + 2.", "4"), ("How many primes are below 10?", "4")]
SYSTEM = "You are a careful mathematician."


def user_text(problem: str) -> str:
    """What the default template makes of a plain problem: the conversational files hold it as it is."""
    return DEFAULT_TEMPLATE.format(problem=problem)


def reference_ids(model: Path, messages: list[dict]) -> list[int]:
    """The chat template applied once, straight from transformers (not through opd's code)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "problem": p, "answer": a}) + "\n"
                            for i, (p, a) in enumerate(PROBLEMS)))
    return path


def verl_rows(system: bool = False) -> list[dict]:
    """verl's layout (its gsm8k/math preprocessors): chat `prompt`, reward_model.ground_truth, extra_info.index."""
    head = [{"role": "system", "content": SYSTEM}] if system else []
    return [{"data_source": "test/math", "prompt": [*head, {"role": "user", "content": user_text(p)}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": "train", "index": 10 + i}} for i, (p, a) in enumerate(PROBLEMS)]


def write_parquet(path: Path, rows: list[dict], row_group_size: int | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def save_trl(path: Path, rows: list[dict] | None = None) -> Path:
    """TRL's conversational prompt format, saved with datasets' save_to_disk."""
    import datasets

    rows = rows or [{"prompt": [{"role": "user", "content": user_text(p)}], "solution": a} for p, a in PROBLEMS]
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def records_of(model: Path, spec: str, *args: str) -> list[dict]:
    return parse(ok(rollout(model, "-n", "1", "--max-tokens", "2", *args, spec)).stdout)


# ----------------------------------------------------------------------------- the same prompts, every format


def test_same_prompt_ids_through_jsonl_verl_parquet_and_trl_dataset(tiny_model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="opd-rollout")
    jsonl = records_of(tiny_model, str(write_jsonl(tmp_path / "p.jsonl")))
    verl = records_of(tiny_model, str(write_parquet(tmp_path / "opd_train.parquet", verl_rows())))
    trl = records_of(tiny_model, str(save_trl(tmp_path / "trl")))
    want = [reference_ids(tiny_model, [{"role": "user", "content": user_text(p)}]) for p, _ in PROBLEMS]
    for recs in (jsonl, verl, trl):
        assert [r["prompt_ids"].tolist() for r in recs] == want
    assert [r["prompt_id"] for r in verl] == ["10", "11", "12"]  # extra_info.index
    assert [r["example"]["answer"] for r in verl] == [a for _, a in PROBLEMS]  # reward_model.ground_truth
    assert verl[0]["example"]["reward_model"] == {"style": "rule", "ground_truth": "42"}  # the row, kept
    assert [r["prompt_id"] for r in trl] == ["trl-1", "trl-2", "trl-3"]  # SOURCE-ROW without an id column
    formats = [r.getMessage() for r in caplog.records if "prompt format" in r.getMessage()]
    assert formats == [  # logged once per input format, not per row
        "prompt format plain: text field 'problem' rendered with --template (first seen at line 1 of p.jsonl)",
        "prompt format verl: messages in 'prompt', gold answer from reward_model.ground_truth, id from "
        "extra_info.index (first seen at row 1 of opd_train.parquet)",
        "prompt format chat: messages in 'prompt' as they are, chat template applied once (first seen at row 1 "
        "of trl)"]


def test_system_messages_are_kept_and_a_full_conversation_ends_at_its_last_user_turn(tiny_model, tmp_path):
    (rec, *_) = records_of(tiny_model, str(write_parquet(tmp_path / "s.parquet", verl_rows(system=True))))
    user = {"role": "user", "content": user_text(PROBLEMS[0][0])}
    assert rec["prompt_ids"].tolist() == reference_ids(tiny_model, [{"role": "system", "content": SYSTEM}, user])
    assert rec["prompt_ids"].tolist() != reference_ids(tiny_model, [user])
    conversation = [{"messages": [{"role": "system", "content": SYSTEM}, user,
                                  {"role": "assistant", "content": "The answer is 42."}]}]
    (rec,) = records_of(tiny_model, str(save_trl(tmp_path / "sft", conversation)))
    assert rec["prompt_ids"].tolist() == reference_ids(tiny_model, [{"role": "system", "content": SYSTEM}, user])


def test_plain_question_and_prompt_field_columns(tiny_model, tmp_path):
    rows = [{"question": p, "answer": a} for p, a in PROBLEMS[:1]]
    (rec,) = records_of(tiny_model, str(write_parquet(tmp_path / "q.parquet", rows)))
    assert rec["prompt_ids"].tolist() == reference_ids(tiny_model, [{"role": "user", "content": user_text(
        PROBLEMS[0][0])}])
    rows = [{"text": p, "messages": "not a conversation"} for p, _ in PROBLEMS[:1]]
    (rec,) = records_of(tiny_model, str(write_parquet(tmp_path / "t.parquet", rows)), "--prompt-field", "text")
    assert rec["prompt_ids"].tolist() == reference_ids(tiny_model, [{"role": "user", "content": user_text(
        PROBLEMS[0][0])}])


def test_folder_of_parquet_files_and_dataset_dict_split(tmp_path, tiny_model):
    import datasets

    folder = tmp_path / "shards"
    folder.mkdir()
    rows = verl_rows()
    write_parquet(folder / "train-00000.parquet", rows[:2])
    write_parquet(folder / "train-00001.parquet", rows[2:])
    got = list(iter_prompt_rows([str(folder)], "id"))
    assert [p.prompt_id for p in got] == ["10", "11", "12"]
    assert got[-1].where.at == "row 1 of shards/train-00001.parquet"
    trl = [{"prompt": [{"role": "user", "content": user_text(p)}]} for p, _ in PROBLEMS]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(trl[:2]),
                          "test": datasets.Dataset.from_list(trl[2:])}).save_to_disk(str(tmp_path / "dd"))
    (rec,) = records_of(tiny_model, f"{tmp_path / 'dd'}:test")
    assert rec["prompt_ids"].tolist() == reference_ids(tiny_model, trl[2]["prompt"])


# ----------------------------------------------------------------------------- bad input: one line each


def error_of(model: Path, spec: str, *args: str) -> str:
    result = rollout(model, "-n", "1", "--max-tokens", "2", *args, spec)
    assert result.exit_code != 0 and not result.stdout
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_parquet_without_a_usable_column(tiny_model, tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [{"id": 1, "text": "What is 6 * 7?", "label": 42}])
    assert error_of(tiny_model, str(path)) == (
        "Error: row 1 of bad.parquet has no prompt: expected a text field (problem, prompt, question) or a "
        "conversation (prompt, messages: {role, content} lists); its columns: id, label, text; name the prompt "
        "column with --prompt-field (or fill --template from the columns)\n")
    assert error_of(tiny_model, str(path), "--prompt-field", "label") == (
        "Error: row 1 of bad.parquet: --prompt-field 'label' is a int, neither text nor a list of {role, content} "
        "messages\n")


def test_conversation_without_a_user_turn(tiny_model, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}]},
            {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "assistant", "content": "42"}]}]
    assert error_of(tiny_model, str(save_trl(tmp_path / "nouser", rows))) == (
        "Error: row 2 of nouser: the conversation in 'prompt' has no user turn (roles: system, assistant); a prompt "
        "needs one (or name a text column with --prompt-field)\n")


def test_split_that_does_not_exist(tiny_model, tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"problem": "x"}])
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    assert error_of(tiny_model, f"{tmp_path / 'dd'}:validation") == (
        f"Error: input {tmp_path / 'dd'}: split 'validation' does not exist (splits: train, test); "
        f"name one: {tmp_path / 'dd'}:SPLIT\n")
    assert error_of(tiny_model, str(tmp_path / "dd")) == (
        f"Error: input {tmp_path / 'dd'} holds a DatasetDict (splits: train, test); "
        f"name one: {tmp_path / 'dd'}:SPLIT\n")


def damaged_parquet(path: Path) -> Path:
    """Three row groups of 100 rows, the third one's first data page overwritten (the footer intact; the file
    under 64 KB, which pyarrow reads whole: hub_server answers no Range requests)."""
    rows = [{"id": i, "problem": f"problem {i}: " + "x" * 100} for i in range(300)]  # under 64 KB (hub_server)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100, compression="none")
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(2).column(1).data_page_offset
    data[start:start + 40] = b"\xff" * 40
    path.write_bytes(bytes(data))
    return path


def test_an_empty_truncated_or_damaged_parquet_is_one_line(tiny_model, tmp_path):
    from opd_common.errors import StreamError

    (tmp_path / "empty.parquet").write_bytes(b"")
    assert error_of(tiny_model, str(tmp_path / "empty.parquet")) == (
        f"Error: {tmp_path / 'empty.parquet'}: not a parquet file (no PAR1 footer); was it written completely?\n")
    whole = write_parquet(tmp_path / "whole.parquet", verl_rows()).read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[:len(whole) // 2])
    assert error_of(tiny_model, str(tmp_path / "cut.parquet")) == (
        f"Error: {tmp_path / 'cut.parquet'}: not a parquet file (no PAR1 footer); was it written completely?\n")
    rows = iter_prompt_rows([str(damaged_parquet(tmp_path / "damaged.parquet"))], "id")
    assert [next(rows).prompt_id for _ in range(200)] == [str(i) for i in range(200)]  # the rows before it
    with pytest.raises(StreamError) as exc:
        next(rows)
    assert str(exc.value).startswith("row 201 of damaged.parquet cannot be read (row group 3 of 3: ")
    assert str(exc.value).endswith("); is the file damaged?") and "\n" not in str(exc.value)


def test_a_conversation_in_datasets_columnar_form(tmp_path):
    """A `Sequence` of {role, content} structs (a card's `sequence:` feature) reads as a dict of lists."""
    import datasets

    from opd_common.prompts import Prompter

    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_text(PROBLEMS[0][0])},
                    {"role": "assistant", "content": "42"}]
    features = datasets.Features({"messages": datasets.Sequence({"role": datasets.Value("string"),
                                                                 "content": datasets.Value("string")})})
    columnar = {"role": [m["role"] for m in conversation], "content": [m["content"] for m in conversation]}
    datasets.Dataset.from_dict({"messages": [columnar]}, features=features).save_to_disk(str(tmp_path / "seq"))
    (prow,) = iter_prompt_rows([str(tmp_path / "seq")], "id")
    assert prow.row["messages"] == columnar  # what datasets gives
    assert Prompter(DEFAULT_TEMPLATE, "problem", "t").messages(prow) == conversation[:2]


# ----------------------------------------------------------------------------- streaming


def byte_range(row_group) -> tuple[int, int]:
    """[start, end) of a row group's column chunks in the file."""
    columns = [row_group.column(j) for j in range(row_group.num_columns)]
    starts = [c.dictionary_page_offset or c.data_page_offset for c in columns]
    return min(starts), max(s + c.total_compressed_size for s, c in zip(starts, columns, strict=True))


class ReadLog(io.FileIO):
    """A file that records which byte ranges were read."""

    def __init__(self, path):
        super().__init__(path, "rb")
        self.ranges: list[tuple[int, int]] = []

    def read(self, size=-1):
        start = self.tell()
        data = super().read(size)
        self.ranges.append((start, start + len(data)))
        return data

    def readinto(self, buf):
        start = self.tell()
        n = super().readinto(buf)
        self.ranges.append((start, start + (n or 0)))
        return n

    def bytes_read(self) -> int:
        return sum(end - start for start, end in self.ranges)


def test_parquet_rows_come_out_before_the_file_is_read(tmp_path):
    """20 row groups of ~100 KB: the first row comes out having read its row group and the footer only.
    (pyarrow's default pre_buffer reads every row group's bytes in one go: this test failed with it.)"""
    rnd = random.Random(0)
    rows = [{"id": i, "problem": "".join(rnd.choices(string.ascii_letters, k=500))} for i in range(4000)]
    path = write_parquet(tmp_path / "big.parquet", rows, row_group_size=200)
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 20
    size = path.stat().st_size
    first = byte_range(meta.row_group(0))
    with ReadLog(path) as f:
        stream = iter_parquet(f, "big.parquet", batch_rows=64)
        row, where = next(stream)
        assert row["id"] == 0 and where.at == "row 1 of big.parquet"
        footer, *data = f.ranges
        assert footer[1] == size and footer[1] - footer[0] <= 64 << 10  # one read at the end: the footer
        assert all(first[0] <= start and end <= first[1] for start, end in data), (data, first)  # row group 0 only
        assert f.bytes_read() < size / 5, (f.bytes_read(), size)
        assert sum(1 for _ in stream) == 3999
        assert f.bytes_read() >= size * 0.9  # and then everything was read


# ----------------------------------------------------------------------------- opd-eval


def test_eval_reads_a_verl_parquet(tiny_model, tmp_path):
    from click.testing import CliRunner

    from opd_common.tables import footer_sha256
    from opd_eval.benchmarks import load_benchmark
    from opd_eval.cli import command

    path = write_parquet(tmp_path / "test.parquet", verl_rows())
    bench = load_benchmark(None, str(path))
    assert [(p.prompt_id, p.answer) for p in bench.problems] == [(str(10 + i), a) for i, (_, a) in enumerate(PROBLEMS)]
    assert bench.name == "data:test.parquet" and bench.file_sha256 == footer_sha256(path)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(command, ["run", "--model", str(tiny_model), "--engine", "hf", "--data", str(path),
                                          "-n", "1", "--max-tokens", "4", "--grade-workers", "1", "--quiet",
                                          "--out", str(out)])
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())
    assert results["benchmark"]["problems"] == 3
    assert [p["answer"] for p in results["metrics"]["per_problem"]] == [a for _, a in PROBLEMS]


def test_prompter_formats_without_a_model():
    from opd_common.prompts import Prompter, PromptRow
    from opd_common.records import Where

    where = Where("x.jsonl", 1)
    default = Prompter(DEFAULT_TEMPLATE, "problem", "t")
    row = {"problem": "p", "messages": [{"role": "user", "content": "m"}]}  # a text problem comes first
    assert default.messages(PromptRow("a", row, where)) == [{"role": "user", "content": user_text("p")}]
    parts = {"prompt": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert default.messages(PromptRow("a", parts, where)) == [{"role": "user", "content": "ab"}]
    custom = Prompter("Q: {q}\nA:", "problem", "t")  # no {problem}: the template is filled from the row as it is
    assert custom.messages(PromptRow("a", {"q": "1+1?"}, where)) == [{"role": "user", "content": "Q: 1+1?\nA:"}]
