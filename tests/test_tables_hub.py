"""hf://datasets/ORG/NAME@REV:SPLIT through datasets' real streaming client, pointed by HF_ENDPOINT at the
loopback Hub (hub_server.py). Each read runs in a subprocess: datasets and huggingface_hub read HF_ENDPOINT
when they are imported."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hub_server import HubServer
from test_rollout import parse
from test_tables import PROBLEMS, damaged_parquet, reference_ids, user_text, verl_rows

READ = """
import json, sys
from opd_common.errors import OpdError
from opd_common.prompts import iter_prompt_rows
try:
    for p in iter_prompt_rows(sys.argv[1:], "id"):
        print(json.dumps({"id": p.prompt_id, "answer": p.row.get("answer"), "at": p.where.at}))
except OpdError as exc:
    sys.exit(f"Error: {exc}")
"""
REPO = "org/math"
CARD = b"---\nlicense: mit\n---\n# math\n"  # a card with metadata, as the Hub's dataset repos have


def parquet_bytes(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A dataset repo with two commits: OLD (the first two problems), then main (all three); and a repo whose
    parquet's third row group is damaged."""
    with HubServer() as server:
        damaged = damaged_parquet(tmp_path_factory.mktemp("hub") / "d.parquet").read_bytes()
        server.state.commits["3" * 40] = {"data/test-00000-of-00001.parquet": damaged, "README.md": CARD}
        server.state.repos["datasets/org/damaged"] = {"private": False, "branches": {"main": "3" * 40}}
        old, new = "1" * 40, "2" * 40
        path = "data/test-00000-of-00001.parquet"
        server.state.commits[old] = {path: parquet_bytes(verl_rows()[:2]), "README.md": CARD}
        server.state.commits[new] = {path: parquet_bytes(verl_rows()), "README.md": CARD}
        server.state.repos[f"datasets/{REPO}"] = {"private": False, "branches": {"main": new}}
        server.old = old
        yield server


def run(hub, tmp_path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0",
           "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1"}
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300)


def read(hub, tmp_path, spec: str) -> list[dict]:
    proc = run(hub, tmp_path, "-c", READ, spec)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_split_and_revision(hub, tmp_path):
    rows = read(hub, tmp_path, f"hf://datasets/{REPO}:test")
    assert rows == [{"id": str(10 + i), "answer": a, "at": f"row {i + 1} of hf://datasets/{REPO}:test"}
                    for i, (_, a) in enumerate(PROBLEMS)]
    assert [r["id"] for r in read(hub, tmp_path, f"hf://datasets/{REPO}@{hub.old}:test")] == ["10", "11"]


def test_rollout_reads_a_hub_dataset(hub, tmp_path, tiny_model):
    proc = run(hub, tmp_path, "-m", "opd_rollout.cli", "--model", str(tiny_model), "--engine", "hf", "-n", "1",
               "--max-tokens", "2", "--quiet", f"hf://datasets/{REPO}:test")
    assert proc.returncode == 0, proc.stderr
    recs = parse(proc.stdout)
    assert [r["prompt_ids"].tolist() for r in recs] == [
        reference_ids(tiny_model, [{"role": "user", "content": user_text(p)}]) for p, _ in PROBLEMS]


@pytest.mark.parametrize("spec, expected", [
    (f"hf://datasets/{REPO}:validation",
     f"Error: input hf://datasets/{REPO}:validation: split 'validation' does not exist (Bad split: validation. "
     f"Available splits: ['test']); name one: hf://datasets/{REPO}[@REV]:SPLIT"),
    (f"hf://datasets/{REPO}",  # the default split, train, is not there either
     f"Error: input hf://datasets/{REPO}: split 'train' does not exist (Bad split: train. "
     f"Available splits: ['test']); name one: hf://datasets/{REPO}[@REV]:SPLIT"),
    ("hf://datasets/org-only", "Error: input 'hf://datasets/org-only': expected "
     "hf://datasets/ORG/NAME[@REVISION][:SPLIT], e.g. hf://datasets/HuggingFaceH4/MATH-500@main:test"),
])
def test_bad_hub_inputs_are_one_line(hub, tmp_path, spec, expected):
    proc = run(hub, tmp_path, "-c", READ, spec)
    assert proc.returncode == 1
    assert proc.stderr == expected + "\n"


def test_a_missing_repo_is_one_line(hub, tmp_path):
    proc = run(hub, tmp_path, "-c", READ, "hf://datasets/org/nothing:test")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("Error: input hf://datasets/org/nothing:test: cannot load it from the Hub (")


def test_a_file_that_fails_mid_stream_is_one_line(hub, tmp_path):
    proc = run(hub, tmp_path, "-c", READ, "hf://datasets/org/damaged:test")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    read = len(proc.stdout.splitlines())  # rows before the damaged row group came out (datasets reads ahead)
    assert 100 <= read <= 200
    assert proc.stderr.startswith(f"Error: row {read + 1} of hf://datasets/org/damaged:test cannot be read ("), \
        proc.stderr
