"""The on-policy loop: opd-rollout --follow RUN_DIR | opd-score | opd-train, as one shell pipeline."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_rollout import BIN, _line_reader, ok, rollout

from opd_common.errors import OpdError
from opd_rollout.run import Follower


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


def loop(tiny_model: Path, tiny_teacher: Path, tmp: Path, engine: str, max_lag: int,
         steps: int = 3) -> tuple[list, list]:
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


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_max_lag_0_is_strictly_on_policy(tiny_model, tiny_teacher, tmp_path, engine):
    """Every record step s trains on was sampled by checkpoint s - 1 (the base model for step 1), the rollout
    stops when the trainer has its 3 steps, and the trainer's importance ratio is 1 and its drift 0 at every
    step: the engine's adapter and the trainer's student are the same policy."""
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
        assert 0 <= row["drift"] < 1e-5, row  # k3 of KL(sampler || trainer): none


@pytest.mark.slow
@pytest.mark.parametrize("max_lag", [1, 2])
def test_max_lag_lets_the_rollout_run_that_many_steps_ahead(tiny_model, tiny_teacher, tmp_path, max_lag):
    """Step s trains on records sampled by checkpoints s - 1 .. s - 1 - L, and batch b waits for no more
    than checkpoint b - L (recipes/opsd.sh runs at L = 2); the trainer's `drift` is above 0 exactly at the steps
    that trained on records of an older checkpoint."""
    records, rows = loop(tiny_model, tiny_teacher, tmp_path, "hf", max_lag=max_lag, steps=4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for step, recs in trained_by_step(records, rows).items():
        assert {r["policy"]["version"] for r in recs} <= set(range(step - 1 - max_lag, step)), step
    batch_versions = [records[i]["policy"]["version"] for i in range(0, len(records), 4)]
    assert batch_versions[:2] == [0, 0]  # the second batch did not wait for step 1
    assert all(v >= b - max_lag for b, v in enumerate(batch_versions))
    assert batch_versions == sorted(batch_versions)
    for row in rows:  # drift (k3 of KL(sampler || trainer)) sees the lag: 0 on-policy, > 0 on older records
        versions = {r["policy"]["version"] for r in trained_by_step(records, rows)[row["step"]]}
        assert (row["drift"] > 1e-5) == (versions != {row["step"] - 1}), (row, versions)


@pytest.mark.slow
@pytest.mark.vllm
def test_max_lag_1_with_vllm_decodes_two_batches_at_once_and_stamps_each_with_its_own_checkpoint(
        tiny_model, tiny_teacher, tmp_path, monkeypatch):
    """vLLM at --max-lag 1 takes a batch while the one before it still decodes (LLMEngine.add_request/step):
    batches 0 and 1 may both start before step 1, so their decode spans overlap (OPD_TIMELINE); each record
    carries the checkpoint its batch started with, the lag stays within 1 and batches come out in order."""
    from opd_common.timeline import read

    monkeypatch.setenv("OPD_TIMELINE", str(tmp_path / "timeline"))
    records, rows = loop(tiny_model, tiny_teacher, tmp_path, "vllm", max_lag=1, steps=4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for step, recs in trained_by_step(records, rows).items():
        assert {r["policy"]["version"] for r in recs} <= {step - 1, step - 2}, step
    for rec in records:
        version = rec["policy"]["version"]
        expected = None if version == 0 else str(tmp_path / "run" / f"checkpoint-{version:06d}")
        assert rec["policy"]["adapter"] == expected
    batch_versions = [records[i]["policy"]["version"] for i in range(0, len(records), 4)]
    assert batch_versions[:2] == [0, 0]
    assert all(v >= b - 1 for b, v in enumerate(batch_versions))
    decode = {s["batch"]: s for s in read(tmp_path / "timeline")
              if s["tool"] == "opd-rollout" and s["name"] == "decode"}
    assert decode[1]["start"] < decode[0]["end"], decode  # batch 1 went in while batch 0 decoded
    adapters = [s for s in read(tmp_path / "timeline") if s["name"] == "adapter"]
    assert [s["version"] for s in adapters] == sorted({s["version"] for s in adapters}) and adapters
    steps = [s for s in read(tmp_path / "timeline") if s["tool"] == "opd-train" and s["name"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_share_policy_hands_every_step_over_without_a_checkpoint(tiny_model, tiny_teacher, tmp_path, engine):
    """opd-train --share-policy --save-every 3: the rollout samples each batch with the adapter the trainer shared
    after the step before (RUN/policy/v-NNNNNN), so --max-lag 0 stays strictly on-policy (importance ratio 1)
    with checkpoints only every third step; the newest POLICY_KEEP shared folders are kept."""
    from opd_common import rundir

    run_dir, rollouts = tmp_path / "run", tmp_path / "rollouts.jsonl"
    command = pipeline(tiny_model, tiny_teacher, tmp_path, engine, 0, 5, rollouts,
                       train_extra="--save-every 3 --share-policy")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in rollouts.read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for step, recs in trained_by_step(records, rows).items():
        assert {r["policy"]["version"] for r in recs} == {step - 1}
        expected = None if step == 1 else str(run_dir / "policy" / f"v-{step - 1:06d}")
        assert {r["policy"]["adapter"] for r in recs} == {expected}
    for row in rows:
        assert row["ratio"] == pytest.approx(1.0, abs=1e-3), row
    assert [c.step for c in rundir.list_checkpoints(run_dir)] == [3, 5]
    assert sorted(p.name for p in (run_dir / "policy").iterdir()) == [
        "latest", *(f"v-{s:06d}" for s in range(6 - rundir.POLICY_KEEP, 6))]
    assert rundir.read_policy(run_dir).step == 5
    # a shared adapter holds the same weights as the checkpoint of its step
    from safetensors.numpy import load_file

    shared, saved = (load_file(str(p / "adapter_model.safetensors"))
                     for p in (run_dir / "policy" / "v-000005", run_dir / "checkpoint-000005"))
    assert shared.keys() == saved.keys() and all((shared[k] == saved[k]).all() for k in shared)


@pytest.mark.slow
def test_a_loop_whose_trainer_fails_at_its_start_ends_at_once(tiny_model, tiny_teacher, tmp_path):
    """opd-train refuses its --out (a killed run's folder, no --resume): the scorer's write fails and it leaves,
    and the rollout, waiting for step 1, sees its stdout closed and leaves too; the pipe fails within seconds
    with the trainer's error (it used to wait out --follow-timeout, an hour by default)."""
    import time

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(
        {"config": {"max_steps": 3, "lora_r": 8, "lora_alpha": 16, "lora_targets": "q_proj,v_proj"}}))
    command = pipeline(tiny_model, tiny_teacher, tmp_path, "hf", 0, 3, tmp_path / "rollouts.jsonl")
    command = command.replace(f"| tee {tmp_path / 'rollouts.jsonl'} ", "")  # the rollout writes to the scorer
    started = time.monotonic()
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command.replace("--limit 20", "--limit 20 "
                                                                           "--follow-timeout 200")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert f"--out {run_dir} is not empty; use --resume" in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - started < 120


@pytest.mark.slow
def test_a_loop_whose_trainer_does_not_checkpoint_every_step_fails_at_once(tiny_model, tiny_teacher, tmp_path):
    """--max-lag 0 with opd-train --save-every 3: batch 1 needs checkpoint 1, which the trainer will not write;
    the pipe fails within seconds naming the fix (it used to hang for --follow-timeout, an hour by default)."""
    command = pipeline(tiny_model, tiny_teacher, tmp_path, "hf", 0, 4, tmp_path / "rollouts.jsonl",
                       train_extra="--save-every 3")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert ("the trainer has done 1 steps and waits for records, but its newest checkpoint is step 0 "
            "(--save-every 3)") in done.stderr, done.stderr[-3000:]
    assert "run opd-train with --share-policy (or --save-every 1) in a --follow loop" in done.stderr
    # the trainer's input ended short: it saved what it did as a resumable checkpoint that says so
    state = json.loads((tmp_path / "run" / "checkpoint-000001" / "trainer_state.json").read_text())
    assert (state["step"], state["max_steps"], state["complete"]) == (1, 4, False)


def complete_lines(path: Path) -> list[dict]:
    """Records of a file a killed writer may have left with a partial last line."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


@pytest.mark.slow
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


# --------------------------------------------------------------------------- dynamic sampling in the loop

# A stand-in verifier (the tiny random model answers nothing right): the g-th prompt of the stream has one
# correct sample of two when g % 3 != 1, else none, so every third group is all wrong and dynamic sampling
# drops it. One line in, one line out, flushed: it streams like opd-score.
MIXED_REWARD = """
import json, sys
groups = []
for line in sys.stdin:
    rec = json.loads(line)
    if rec["prompt_id"] not in groups:
        groups.append(rec["prompt_id"])
    correct = groups.index(rec["prompt_id"]) % 3 != 1 and rec["sample"] == 0
    rec["reward"] = dict(rec["reward"], correct=correct, total=float(correct))
    sys.stdout.write(json.dumps(rec) + "\\n")
    sys.stdout.flush()
"""


@pytest.mark.slow
def test_dynamic_sampling_loop_samples_for_a_starved_trainer_and_stays_on_policy(tiny_model, tmp_path):
    """--loss dapo with --max-lag 0: a rollout batch whose groups are dropped leaves the step short; the trainer
    says so in reader.json and the rollout samples another batch with the same checkpoint instead of waiting
    (--follow-timeout 60 would fail the pipe). Groups left over from such a batch are dropped as stale by
    --max-staleness 0, so every record a step trains on was sampled by the previous step's checkpoint.

    The stream, 2 prompts a batch (groups g0 g1 | g2 g3 | ...; g1, g4, g7 all wrong): step 1 keeps g0, is
    starved, gets g2 g3 (version 0) and keeps g2; step 2 drops g3 (stale) and g4 (uniform), keeps g5, is
    starved, gets g6 g7 (version 1) and keeps g6; step 3 drops g7 (stale), keeps g8 g9."""
    run_dir, rollouts = tmp_path / "run", tmp_path / "rollouts.jsonl"
    (tmp_path / "reward.py").write_text(MIXED_REWARD)
    command = (
        f"{BIN}/opd-rollout --model {tiny_model} --engine hf --follow {run_dir} --max-lag 0 --follow-timeout 60 "
        f"--batch-prompts 2 -n 2 --max-tokens 8 --limit 20 train-math | tee {rollouts} | "
        f"{BIN}/opd-score --reward math --quiet | {BIN}/python -u {tmp_path / 'reward.py'} | "
        f"{BIN}/opd-train --model {tiny_model} --loss dapo --max-staleness 0 --out {run_dir} --max-steps 3 "
        f"--batch-groups 2 --save-every 1 --lora-r 8 --lora-alpha 16 --lr 1e-3 --quiet")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sampling another batch with version 0" in done.stderr, done.stderr[-3000:]
    records = [json.loads(line) for line in rollouts.read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["groups_read"], r["groups_dropped"], r["records_stale"]) for r in rows] == [
        (1, 3, 1, 0), (2, 3, 1, 2), (3, 2, 0, 2)]
    assert [records[i]["policy"]["version"] for i in range(0, len(records), 4)] == [0, 0, 1, 1, 2]
    mixed, start = mixed_prompts(records), 0
    for row in rows:  # the groups a step kept: not stale, not all wrong; all sampled by checkpoint step - 1
        read, start = records[start:row["records_read"]], row["records_read"]
        kept = [r for r in read if r["policy"]["version"] >= row["step"] - 1 and r["prompt_id"] in mixed]
        assert len(kept) == 4 == row["records"], row["step"]
        assert {r["policy"]["version"] for r in kept} == {row["step"] - 1}, row["step"]
        assert row["ratio"] == pytest.approx(1.0, abs=1e-3), row
    reader = json.loads((run_dir / "reader.json").read_text())  # written whenever its input ran dry
    assert reader["filling"] == reader["steps_done"] + 1 <= 3 and reader["records_read"] <= 16


def mixed_prompts(records: list) -> set:
    """The prompt ids MIXED_REWARD gives one right answer (the g-th prompt in stream order, g % 3 != 1)."""
    order = list(dict.fromkeys(r["prompt_id"] for r in records))
    return {p for g, p in enumerate(order) if g % 3 != 1}


class _Config:
    follow_timeout, max_lag, n = 0.3, 0, 2

    def __init__(self, run_dir: Path):
        self.follow = str(run_dir)


def test_follower_samples_again_only_for_a_trainer_that_has_read_everything(tmp_path):
    """At its lag limit the rollout samples another batch only when the trainer's reader.json (written by this
    trainer, not a killed one) says it is still at the newest checkpoint's step and has read every record the
    rollout wrote; a trainer that is behind still fails after --follow-timeout, naming what it read."""
    import time

    def reader(steps_done: int, read: int) -> None:
        (tmp_path / "reader.json").write_text(json.dumps(
            {"steps_done": steps_done, "filling": steps_done + 1, "records_read": read, "time": time.time()}))

    (tmp_path / "config.json").write_text(json.dumps({"config": {"max_steps": 3, "max_staleness": 0}}))
    reader(0, 4)  # a killed trainer's, there before the rollout started
    follower = Follower(_Config(tmp_path))
    follower.batch, follower.emitted = 1, 4  # batch 0 (4 records) written; batch 1 needs step 1
    stuck = (f"--follow {tmp_path}: the trainer is at step 0, batch 1 needs step >= 1, and nothing changed for "
             "--follow-timeout 0.3 s")
    hint = " (is opd-train running with --share-policy or --save-every 1?)"
    for state, read in [(None, None), ((0, 2), 2)]:
        if state is not None:
            reader(*state)  # still reading
        with pytest.raises(OpdError) as error:
            follower.before_batch(engine=None)
        reading = "" if read is None else f"; it has read {read} of the 4 records sampled"
        assert str(error.value) == stuck + reading + hint, state
    # a trainer a step past its newest checkpoint, waiting for records: it will not write the checkpoint
    # this batch needs, so the rollout fails at once (not after --follow-timeout) and says why
    (tmp_path / "config.json").write_text(json.dumps({"config": {"max_steps": 3, "max_staleness": 0, "save_every": 2}}))
    reader(1, 4)
    follower.config.follow_timeout = 3600
    started = time.monotonic()
    with pytest.raises(OpdError) as error:
        follower.before_batch(engine=None)
    assert time.monotonic() - started < 5
    assert str(error.value) == (
        f"--follow {tmp_path}: the trainer has done 1 steps and waits for records, but its newest checkpoint is "
        "step 0 (--save-every 2), so this rollout cannot sample the next batch with --max-lag 0: run opd-train "
        "with --share-policy (or --save-every 1) in a --follow loop")
    follower.config.follow_timeout = 0.3
    reader(0, 4)  # starved: sample again (same version), still waiting for step 1 before batch 1
    assert follower.before_batch(engine=None) is True
    assert (follower.batch, follower.version) == (1, 0)


@pytest.mark.slow  # real subprocesses: interpreter, torch and two workers' start-up
def test_data_parallel_scorer_writes_each_window_while_its_input_pauses(tiny_model, tmp_path):
    """opd-score --data-parallel 2 in the loop: the rollout writes a batch and waits for the trainer, which
    waits for that batch's scores; they come out while the scorer's stdin stays open (they used to wait for
    the next window or the end of input, a deadlock)."""
    records = ok(rollout(tiny_model, "-n", "2", "--max-tokens", "4", "--limit", "2", "train-math")).stdout_bytes
    lines_in = records.splitlines(keepends=True)
    cmd = [str(BIN / "opd-score"), "--quiet", "--reward", "math", "--data-parallel", "2", "-"]
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        try:
            lines = _line_reader(proc.stdout)
            for batch in (lines_in[:2], lines_in[2:]):
                proc.stdin.write(b"".join(batch))
                proc.stdin.flush()
                for line in batch:
                    out = lines.get(timeout=120)  # stdin stays open: only streaming can produce this
                    assert out is not None, (tmp_path / "stderr").read_text()
                    assert json.loads(out)["id"] == json.loads(line)["id"] and "reward" in json.loads(out)
            proc.stdin.close()
            assert proc.wait(timeout=60) == 0, (tmp_path / "stderr").read_text()
            assert lines.get(timeout=5) is None
        finally:
            if not proc.stdin.closed:
                proc.stdin.close()  # ends the workers too (a killed parent would leave them behind)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
