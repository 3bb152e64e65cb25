"""opd_common.rundir: names, `latest`, which checkpoints are finished, the follower's view, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd_common import rundir
from opd_common.errors import ConfigError


def make_run(path: Path, steps: tuple[int, ...], latest: int | None) -> Path:
    for step in steps:
        (path / rundir.checkpoint_name(step)).mkdir(parents=True)
        (path / rundir.checkpoint_name(step) / rundir.TRAINER_STATE).write_text(json.dumps({"step": step}))
    path.mkdir(parents=True, exist_ok=True)
    if latest is not None:
        (path / rundir.LATEST).write_text(rundir.checkpoint_name(latest) + "\n")
    return path


def test_names_and_their_parser():
    assert rundir.checkpoint_name(50) == "checkpoint-000050"
    assert rundir.checkpoint_name(1234567) == "checkpoint-1234567"
    assert rundir.parse_checkpoint_name("checkpoint-000050") == 50
    assert rundir.parse_checkpoint_name("checkpoint-500") == 500  # another trainer's folder (opd-eval --adapter)
    for other in ("checkpoint-", "checkpoint-12a", ".checkpoint-000050.tmp", "latest"):
        assert rundir.parse_checkpoint_name(other) is None


def test_finished_checkpoints_are_the_folders_up_to_latest(tmp_path):
    run = make_run(tmp_path / "run", (1, 2, 3), latest=2)  # 3: renamed into place, then the save crashed
    (run / ".checkpoint-000004.tmp").mkdir()
    (run / "checkpoint-5").mkdir()  # not a name opd-train writes
    assert [(c.step, c.name) for c in rundir.list_checkpoints(run)] == [(1, "checkpoint-000001"),
                                                                       (2, "checkpoint-000002")]
    assert rundir.read_latest(run) == rundir.Checkpoint(2, run / "checkpoint-000002")
    assert rundir.read_latest(run).state() == {"step": 2}
    assert rundir.find_checkpoint(run, 1).path == run / "checkpoint-000001"
    assert rundir.find_checkpoint(run, 3) is None and rundir.find_checkpoint(run, 7) is None


def test_a_run_without_latest_trusts_its_folders(tmp_path):
    run = make_run(tmp_path / "run", (25, 50), latest=None)
    assert rundir.read_latest(run) is None
    assert [c.step for c in rundir.list_checkpoints(run)] == [25, 50]
    assert rundir.find_checkpoint(run, 50) is not None
    assert rundir.list_checkpoints(tmp_path / "nowhere") == []


def test_latest_naming_no_folder_is_an_error(tmp_path):
    run = make_run(tmp_path / "run", (1,), latest=2)
    with pytest.raises(ConfigError) as error:
        rundir.read_latest(run)
    assert str(error.value) == (f"{run / 'latest'} points to checkpoint-000002, which is missing or incomplete; "
                                "the run directory was edited by hand?")


def test_the_followers_view_of_a_live_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.READER).write_text('{"steps_done": 9}')  # a killed trainer's
    reader = rundir.RunReader(run)
    assert reader.config() == {} and reader.latest() is None and reader.reader() == {}
    (run / rundir.CONFIG).write_text(json.dumps({"config": {"max_steps": 3}}))
    assert reader.config() == {"max_steps": 3}
    (run / rundir.CONFIG).write_text(json.dumps({"config": {"max_steps": 30}}))  # parsed again: it changed
    assert reader.config() == {"max_steps": 30}
    (run / rundir.READER).write_text('{"steps_done": 0}')
    assert reader.reader() == {"steps_done": 0}
    make_run(run, (1,), latest=1)
    assert reader.latest().step == 1
    (run / rundir.LATEST).write_text("checkpoint-000002\n")  # its folder not visible here yet
    assert reader.latest().step == 1


def test_atomic_writes_leave_no_temporary(tmp_path):
    rundir.atomic_write_text(tmp_path / "latest", "checkpoint-000001\n")
    rundir.atomic_write_bytes(tmp_path / "latest", b"checkpoint-000002\n")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "a").write_text("x")
    rundir.fsync_tree(tmp_path / "ck")
    assert (tmp_path / "latest").read_text() == "checkpoint-000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "latest"]
