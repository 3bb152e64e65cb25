"""opd-cat --parquet: records as one parquet row each, read back exactly; the docs' pandas query (docs/records.md)."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow.parquet as pq
from click.testing import CliRunner
from test_cat import as_stdin, reward, sample_records
from test_records import assert_records_equal, make_record

from opd_common.cat import command
from opd_common.records import validate
from opd_common.streams import decode_line


def records() -> list[dict]:
    """sample_records (teachers on some, two teacher names, rewards on some) plus top-k and shift blocks."""
    shift = {"post": "P", "pre": "Q", "k": 2, "ids": np.array([[5, 6], [7, 8]], np.int32),
             "delta": np.array([[0.5, -0.25], [0.125, 0.0]], np.float32)}
    extra = make_record("p2", 0, (9, 2), k=2, reward=reward(True, True, 0.0))
    extra["shift"] = shift
    extra["example"]["solution"] = None  # a null the other records do not have at all
    return [*sample_records(), make_record("p1", 2, (4, 5, 2), k=3, version=7), extra]


def to_parquet(recs: list[dict], out, *args: str):
    return CliRunner().invoke(command, ["--parquet", str(out), *args], input=as_stdin(recs))


def read_back(path) -> list[dict]:
    result = CliRunner().invoke(command, [str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [validate(decode_line(line, "x"), "x") for line in result.stdout_bytes.splitlines()]


def test_round_trip_keeps_every_field(tmp_path):
    out = tmp_path / "scored.parquet"
    result = to_parquet(records(), out)
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["scored.parquet"]
    got = read_back(out)
    want = [validate(copy.deepcopy(r), "want") for r in records()]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_records_equal(g, w)
    assert "teachers" not in got[2] and "u" not in got[0]["teachers"] and got[-1]["example"]["solution"] is None


def test_per_token_arrays_are_typed_list_columns(tmp_path):
    to_parquet(records(), tmp_path / "r.parquet")
    schema = pq.read_schema(tmp_path / "r.parquet")
    assert str(schema.field("response_ids").type) == "list<element: int32>"
    assert str(schema.field("logprobs").type) == "list<element: float>"
    assert str(schema.field("topk_ids").type) == "list<element: list<element: int32>>"
    assert str(schema.field("teachers").type.field("t").type.field("logprobs").type) == "list<element: float>"
    assert str(schema.field("shift").type.field("delta").type) == "list<element: list<element: float>>"


def test_docs_pandas_query_over_a_scored_run(tmp_path):
    """The query in docs/records.md, against numpy over the records themselves."""
    import pandas as pd

    recs = records()
    to_parquet(recs, tmp_path / "scored.parquet")
    # --- as in docs/records.md
    df = pd.read_parquet(tmp_path / "scored.parquet")
    df["length"] = df["response_ids"].map(len)
    df["teacher_lp"] = df["teachers"].map(lambda t: t["t"]["logprobs"].mean() if t and t["t"] else None)
    df["reward_total"] = df["reward"].map(lambda r: r["total"] if r else None)
    by_length = df.groupby(pd.cut(df["length"], [0, 4, 8, 16]), observed=True)["reward_total"].mean()
    # ---
    teacher = {r["id"]: r["teachers"]["t"]["logprobs"].mean() for r in recs if "t" in r.get("teachers", {})}
    got = df.set_index("id")["teacher_lp"].dropna().to_dict()
    assert sorted(got) == sorted(teacher) and len(teacher) == 3
    np.testing.assert_allclose([got[k] for k in teacher], list(teacher.values()), rtol=1e-6)
    rewards = [(len(r["response_ids"]), r["reward"]["total"]) for r in recs if "reward" in r]
    want = [np.mean([t for n, t in rewards if lo < n <= hi]) for lo, hi in ((0, 4), (4, 8), (8, 16))]
    np.testing.assert_allclose(by_length.to_numpy(), want)


def test_a_bad_record_leaves_no_file(tmp_path):
    bad = as_stdin(records()[:2]) + b'{"schema": "opd/1"}\n'
    result = CliRunner().invoke(command, ["--parquet", str(tmp_path / "r.parquet")], input=bad)
    assert result.exit_code == 1
    assert result.stderr == "Error: record 3 of <stdin> has no 'id' (was it written by opd-rollout?)\n"
    assert list(tmp_path.iterdir()) == []


def test_a_field_whose_type_changes_is_one_error_line(tmp_path):
    a, b = make_record("p0", 0), make_record("p0", 1)
    b["example"]["answer"] = {"value": 42}
    result = to_parquet([a, b], tmp_path / "r.parquet")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("Error: records 1-2: a field's type differs from earlier records' and parquet "
                                    "needs one type per column (")
    assert list(tmp_path.iterdir()) == []


def test_parquet_and_summary_together_are_refused(tmp_path):
    result = to_parquet(records(), tmp_path / "r.parquet", "--summary")
    assert result.stderr == ("Error: --parquet writes the records and --summary prints one summary instead; "
                             "give one of them\n")
