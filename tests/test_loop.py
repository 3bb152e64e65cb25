"""The on-policy loop: opd-rollout --follow RUN_DIR | opd-score | opd-train, as one shell pipeline."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from test_rollout import BIN

pytestmark = pytest.mark.slow


def pipeline(tiny_model: Path, tiny_teacher: Path, tmp: Path, engine: str, max_lag: int, steps: int,
             rollouts: Path, train_extra: str = "") -> str:
    run_dir = tmp / "run"
    extra = "--eager" if engine == "vllm" else ""
    return (
        f"{BIN}/opd-rollout --model {tiny_model} --engine {engine} {extra} --follow {run_dir} --max-lag {max_lag} "
        f"--batch-prompts 2 -n 2 --max-tokens 8 --limit 20 --quiet train-math | tee {rollouts} | "
        f"{BIN}/opd-score --teacher t={tiny_teacher} --quiet | "
        f"{BIN}/opd-train --model {tiny_model} --loss rkl --out {run_dir} --max-steps {steps} --batch-groups 2 "
        f"--save-every 1 --lora-r 8 --lora-alpha 16 --lr 1e-3 --quiet {train_extra}")


def loop(tiny_model: Path, tiny_teacher: Path, tmp: Path, engine: str, max_lag: int, steps: int = 3) -> tuple[list, list]:
    """Run the pipeline; return (rollout records in stream order, trainer metrics rows)."""
    run_dir, rollouts = tmp / "run", tmp / "rollouts.jsonl"
    command = pipeline(tiny_model, tiny_teacher, tmp, engine, max_lag, steps, rollouts)
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in rollouts.read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, rows


def trained_by_step(records: list, rows: list) -> dict[int, list]:
    """The records each step trained on (steps take whole groups in stream order here)."""
    out, start = {}, 0
    for row in rows:
        out[row["step"]] = records[start:row["records_read"]]
        start = row["records_read"]
    return out


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_max_lag_0_is_strictly_on_policy(tiny_model, tiny_teacher, tmp_path, engine):
    """Every record step s trains on was sampled by checkpoint s - 1 (the base model for step 1), the rollout
    stops when the trainer has its 3 steps, and the trainer's importance ratio is 1 at every step: the
    engine's adapter and the trainer's student are the same policy."""
    records, rows = loop(tiny_model, tiny_teacher, tmp_path, engine, max_lag=0)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for step, recs in trained_by_step(records, rows).items():
        assert len(recs) == 4
        assert {r["policy"]["version"] for r in recs} == {step - 1}
        expected = None if step == 1 else str(tmp_path / "run" / f"checkpoint-{step - 1:06d}")
        assert {r["policy"]["adapter"] for r in recs} == {expected}
    assert len(records) <= 12 + 4  # at most the batch that was sampling when the trainer finished
    for row in rows:
        assert row["ratio"] == pytest.approx(1.0, abs=1e-3), row


def test_max_lag_1_lets_the_rollout_run_one_step_ahead(tiny_model, tiny_teacher, tmp_path):
    records, rows = loop(tiny_model, tiny_teacher, tmp_path, "hf", max_lag=1, steps=4)
    for step, recs in trained_by_step(records, rows).items():
        assert {r["policy"]["version"] for r in recs} <= {step - 1, step - 2}, step
    batch_versions = [records[i]["policy"]["version"] for i in range(0, len(records), 4)]
    assert batch_versions[:2] == [0, 0]  # the second batch did not wait for step 1
    assert all(v >= b - 1 for b, v in enumerate(batch_versions))


def complete_lines(path: Path) -> list[dict]:
    """Records of a file a killed writer may have left with a partial last line."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def test_killed_loop_resumes_from_its_checkpoint_and_trains_no_record_twice(tiny_model, tiny_teacher, tmp_path):
    """The whole pipeline is killed (SIGKILL) once checkpoint 2 exists; restarted with opd-train --resume
    --input-continues, the rollout skips the prompts already trained and the run ends at exactly 5 steps."""
    import os
    import signal
    import time

    run_dir = tmp_path / "run"
    first = subprocess.Popen(["bash", "-o", "pipefail", "-c",
                              pipeline(tiny_model, tiny_teacher, tmp_path, "hf", 0, 5, tmp_path / "roll1.jsonl")],
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not ((run_dir / "latest").exists() and (run_dir / "latest").read_text().strip() >= "checkpoint-000002"):
        assert first.poll() is None and time.monotonic() < deadline, "the first pipeline ended before checkpoint 2"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    resumed_from = run_dir / (run_dir / "latest").read_text().strip()
    state = json.loads((resumed_from / "trainer_state.json").read_text())
    k, read_k = state["step"], state["records_read"]
    assert 2 <= k < 5

    command = pipeline(tiny_model, tiny_teacher, tmp_path, "hf", 0, 5, tmp_path / "roll2.jsonl",
                       "--resume --input-continues")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    trained_first = complete_lines(tmp_path / "roll1.jsonl")[:read_k]
    assert len(trained_first) == read_k
    trained_second = complete_lines(tmp_path / "roll2.jsonl")[:rows[-1]["records_read"] - read_k]
    ids = [r["id"] for r in trained_first + trained_second]
    assert len(ids) == len(set(ids)) == 5 * 4  # every trained record once, 5 steps x 2 groups x 2 samples
    for step, recs in trained_by_step(trained_first + trained_second, rows).items():
        assert {r["policy"]["version"] for r in recs} == {step - 1}, step
