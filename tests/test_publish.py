"""opd-publish against a file:// mirror: push/verify/pull, immutability and faults (corrupted files,
failed and interrupted uploads, different content under a published step), the model card, and a
real opd-train checkpoint that loads with peft after push + pull."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from opd_publish import cli
from opd_publish.targets import FileTarget

INDEX = "checkpoint_index.json"


def publish(*args: str):
    return CliRunner().invoke(cli.command, [*args])


def ok(result):
    assert result.exit_code == 0, f"exit {result.exit_code}\nstderr: {result.stderr}\n{result.exception!r}"
    return result


def records(result) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines()]


def error_of(result) -> str:
    assert result.exit_code == 1, result.stdout
    return result.stderr


def make_run(path: Path, steps=(1, 2), max_steps: int = 2) -> Path:
    """A fake opd-train run dir with small files in the real layout."""
    path.mkdir(parents=True)
    config = {"tool": "opd-train", "version": "0.1.0", "inputs": ["scored.jsonl"],
              "config": {"model": "Qwen/Qwen3-1.7B", "revision": "abc123", "loss": "rkl", "lr": 1e-4,
                         "lora_r": 8, "lora_alpha": 16, "max_steps": max_steps, "batch_groups": 8}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "scored.jsonl").write_text('{"id": "x"}\n')
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 0.5 / s, "reverse_kl": 0.25 / s, "grad_norm": 1.0,
                    "records_read": 16 * s}) + "\n"
        for s in range(1, max(steps) + 1)))
    for s in steps:
        ck = path / f"checkpoint-{s:06d}"
        ck.mkdir()
        (ck / "adapter_model.safetensors").write_bytes(bytes([s]) * 1000)
        (ck / "adapter_config.json").write_text('{"r": 8}')
        (ck / "tokenizer.json").write_text('{"tok": 1}')
        (ck / "trainer_state.json").write_text(json.dumps({"step": s, "max_steps": max_steps,
                                                           "complete": s == max_steps}))
        (ck / "trainer_state.pt").write_bytes(b"resume" * 10 + bytes([s]))
    (path / "latest").write_text(f"checkpoint-{max(steps):06d}\n")
    return path


@pytest.fixture
def run(tmp_path) -> Path:
    return make_run(tmp_path / "run")


@pytest.fixture
def mirror(tmp_path) -> Path:
    return tmp_path / "mirror"


def url(p: Path) -> str:
    return f"file://{p}"


def index_of(mirror: Path) -> dict:
    return json.loads((mirror / INDEX).read_text())


# --------------------------------------------------------------------------- push / verify / pull


def test_push_layout_index_card_and_noop_repush(run, mirror):
    out = records(ok(publish("push", str(run), "--repo", url(mirror))))
    assert [(r["step"], r["status"]) for r in out] == [(1, "published"), (2, "published")]
    names = sorted(FileTarget(mirror).list_files())
    assert names == ["README.md", "checkpoint-000001/adapter_config.json",
                     "checkpoint-000001/adapter_model.safetensors",
                     "checkpoint-000001/sha256sums.txt", "checkpoint-000001/tokenizer.json",
                     "checkpoint-000001/trainer_state.json", "checkpoint-000002/adapter_config.json",
                     "checkpoint-000002/adapter_model.safetensors", "checkpoint-000002/sha256sums.txt",
                     "checkpoint-000002/tokenizer.json", "checkpoint-000002/trainer_state.json", INDEX]
    index = index_of(mirror)
    assert [e["step"] for e in index["checkpoints"]] == [1, 2]
    entry = index["checkpoints"][1]
    assert entry["metrics"]["loss"] == 0.25 and entry["files"]["adapter_model.safetensors"] == 1000
    assert entry["commit"] == out[1]["commit"] and entry["completed_at"].endswith("Z")
    sums = (mirror / "checkpoint-000002" / "sha256sums.txt").read_text()
    assert "  adapter_model.safetensors\n" in sums and "trainer_state.pt" not in sums
    card = (mirror / "README.md").read_text()
    assert "base_model: Qwen/Qwen3-1.7B" in card and "`abc123`" in card
    assert "| 2 | 0.25 | 0.125 | 1 | 32 | `" in card  # step, loss, reverse_kl, grad_norm, records_read
    assert f"PeftModel.from_pretrained(base, '{mirror}/checkpoint-000002')" in card and "LoRARequest" in card
    assert "| `scored.jsonl` | `" in card  # data hash of an input still present
    before = (mirror / INDEX).read_bytes()
    again = records(ok(publish("push", str(run), "--repo", url(mirror))))
    assert [r["status"] for r in again] == ["unchanged", "unchanged"]
    assert (mirror / INDEX).read_bytes() == before
    assert [r["ok"] for r in records(ok(publish("verify", url(mirror), "--local", str(run))))] == [True, True]


def test_checkpoint_selection_and_resume_state(tmp_path, mirror):
    run = make_run(tmp_path / "run", steps=(1, 2, 3), max_steps=3)
    out = records(ok(publish("push", str(run), "--repo", url(mirror), "--checkpoints", "3,1")))
    assert [r["step"] for r in out] == [1, 3]
    out = records(ok(publish("push", str(run), "--repo", url(mirror), "--checkpoints", "latest",
                             "--with-resume-state")))
    assert out[0]["status"] == "unchanged" and out[1] == {**out[1], "resume_step": 3, "status": "published"}
    assert ((mirror / "latest-resume" / "trainer_state.pt").read_bytes()
            == (run / "checkpoint-000003" / "trainer_state.pt").read_bytes())
    assert index_of(mirror)["latest_resume"]["step"] == 3
    assert [e["step"] for e in index_of(mirror)["checkpoints"]] == [1, 3]
    assert error_of(publish("push", str(run), "--repo", url(mirror), "--checkpoints", "7")) == (
        f"Error: --checkpoints 7: no checkpoint for step(s) [7] in {run} (it has [1, 2, 3])\n")
    (run / "latest").write_text("checkpoint-000002\n")  # 3 as left by a save that crashed before `latest` moved
    assert "(it has [1, 2])" in error_of(publish("push", str(run), "--repo", url(mirror), "--checkpoints", "3"))
    ok(publish("verify", url(mirror)))


def test_pull_verifies_and_fetches(run, mirror, tmp_path):
    ok(publish("push", str(run), "--repo", url(mirror)))
    dest = tmp_path / "pulled"
    rec = records(ok(publish("pull", url(mirror), str(dest), "--checkpoint", "latest")))[0]
    assert rec["step"] == 2 and rec["files"] == 4
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "trainer_state.json"):
        assert (dest / name).read_bytes() == (run / "checkpoint-000002" / name).read_bytes()
    assert error_of(publish("pull", url(mirror), str(dest), "--checkpoint", "1")) == (
        f"Error: DIR {dest} already exists and is not empty; give a new directory\n")
    assert error_of(publish("pull", url(mirror), str(tmp_path / "x"), "--checkpoint", "5")) == (
        f"Error: {url(mirror)}: checkpoint-000005 is not published (published steps: [1, 2])\n")


# --------------------------------------------------------------------------- faults


def test_corrupted_remote_file_is_detected_by_verify_and_pull(run, mirror, tmp_path):
    ok(publish("push", str(run), "--repo", url(mirror)))
    (mirror / "checkpoint-000001" / "adapter_model.safetensors").write_bytes(b"\x00" * 1000)  # same size
    result = publish("verify", url(mirror))
    assert error_of(result).startswith(
        f"Error: {url(mirror)} failed verification: checkpoint-000001/adapter_model.safetensors has sha256 ")
    assert "(corrupted or changed)" in result.stderr
    assert [r["ok"] for r in records(result)] == [False, True]
    assert "(corrupted on the target); nothing was written to DIR" in error_of(
        publish("pull", url(mirror), str(tmp_path / "p"), "--checkpoint", "1"))
    assert not (tmp_path / "p").exists()
    (mirror / "checkpoint-000002" / "tokenizer.json").write_text("{}")  # other size
    assert "checkpoint-000002/tokenizer.json has 2 bytes, expected 10" in error_of(publish("verify", url(mirror)))


def test_different_content_under_a_published_step_is_refused(run, mirror):
    ok(publish("push", str(run), "--repo", url(mirror), "--checkpoints", "1"))
    before = (mirror / "checkpoint-000001" / "adapter_model.safetensors").read_bytes()
    (run / "checkpoint-000001" / "adapter_model.safetensors").write_bytes(b"other" * 200)
    err = error_of(publish("push", str(run), "--repo", url(mirror)))
    assert err.startswith(f"Error: {url(mirror)}: checkpoint-000001 is already published with different content")
    assert err.endswith("published checkpoints are immutable: push this run to a new repo\n")
    assert (mirror / "checkpoint-000001" / "adapter_model.safetensors").read_bytes() == before
    assert [e["step"] for e in index_of(mirror)["checkpoints"]] == [1]  # step 2 not pushed after the error
    assert "differs from --local" in error_of(publish("verify", url(mirror), "--local", str(run)))


def test_unindexed_leftover_with_other_content_is_refused(run, mirror, tmp_path):
    other = make_run(tmp_path / "other", steps=(1,), max_steps=2)
    (other / "checkpoint-000001" / "adapter_config.json").write_text('{"r": 16}')
    ok(publish("push", str(other), "--repo", url(mirror)))
    (mirror / INDEX).unlink()  # as if that push died before indexing
    assert "checkpoint-000001 exists with a different sha256sums.txt than the local checkpoint" in error_of(
        publish("push", str(run), "--repo", url(mirror)))


def test_interrupted_push_is_resumed_and_nothing_unverified_is_indexed(run, mirror):
    """A checkpoint folder copied (partly) but never indexed: the next push completes it."""
    ok(publish("push", str(run), "--repo", url(mirror), "--checkpoints", "1"))
    part = mirror / "checkpoint-000002"
    part.mkdir()
    (part / "adapter_model.safetensors").write_bytes(
        (run / "checkpoint-000002" / "adapter_model.safetensors").read_bytes()[:500])
    (part / "adapter_config.json").write_bytes((run / "checkpoint-000002" / "adapter_config.json").read_bytes())
    assert [e["step"] for e in index_of(mirror)["checkpoints"]] == [1]
    out = records(ok(publish("verify", url(mirror))))  # the leftover is not published: verify passes, warns
    assert [r["path"] for r in out] == ["checkpoint-000001"]
    out = records(ok(publish("push", str(run), "--repo", url(mirror))))
    assert [r["status"] for r in out] == ["unchanged", "published"]
    assert [e["step"] for e in index_of(mirror)["checkpoints"]] == [1, 2]
    ok(publish("verify", url(mirror), "--local", str(run)))


def test_failed_upload_leaves_nothing_indexed(run, mirror, monkeypatch):
    calls = {"n": 0}
    real = FileTarget.commit

    def flaky(self, adds, message):
        calls["n"] += 1
        if message == "Add checkpoint-000002":
            raise OSError(28, "No space left on device")
        return real(self, adds, message)

    monkeypatch.setattr(FileTarget, "commit", flaky)
    err = error_of(publish("push", str(run), "--repo", url(mirror)))
    assert err == (f"Error: {url(mirror)}: upload of checkpoint-000002 failed (OSError: [Errno 28] No space left on "
                   "device); nothing unverified was added to checkpoint_index.json; "
                   "run the same push again to resume\n")
    assert [e["step"] for e in index_of(mirror)["checkpoints"]] == [1]


def test_upload_that_lands_corrupted_is_not_indexed(run, mirror, monkeypatch):
    real = FileTarget.commit

    def corrupting(self, adds, message):
        commit = real(self, adds, message)
        bad = self.root / "checkpoint-000002" / "adapter_model.safetensors"
        if bad.exists():
            bad.write_bytes(b"\xff" * 1000)
        return commit

    monkeypatch.setattr(FileTarget, "commit", corrupting)
    err = error_of(publish("push", str(run), "--repo", url(mirror)))
    assert err.startswith(f"Error: {url(mirror)}: checkpoint-000002 did not verify after upload: "
                          "checkpoint-000002/adapter_model.safetensors has sha256 ")
    assert [e["step"] for e in index_of(mirror)["checkpoints"]] == [1]
    monkeypatch.setattr(FileTarget, "commit", real)
    assert [r["status"] for r in records(ok(publish("push", str(run), "--repo", url(mirror))))] == [
        "unchanged", "published"]


def test_bad_arguments_are_clear(run, tmp_path):
    assert error_of(publish("push", str(run), "--repo", "s3://bucket/x")) == (
        "Error: --repo 's3://bucket/x': use hf://ORG/NAME, file:///DIR or ORG/NAME\n")
    assert error_of(publish("push", str(tmp_path), "--repo", url(tmp_path / "m"))) == (
        f"Error: RUN_DIR {tmp_path} has no config.json (is it an opd-train --out directory?)\n")
    assert error_of(publish("push", str(run), "--repo", url(tmp_path / "m"), "--revision", "dev")) == (
        "Error: --revision applies to hf:// targets only (a file:// mirror has one branch)\n")
    assert error_of(publish("verify", url(tmp_path / "nothing"))) == (
        f"Error: {url(tmp_path / 'nothing')}: no such directory (nothing was published there)\n")


def test_console_script_pipeline(run, mirror, tmp_path):
    """The installed script in a real pipe: push's records on stdout, nothing else there."""
    import subprocess
    import sys

    script = str(Path(sys.executable).with_name("opd-publish"))
    out = subprocess.run(f"{script} push {run} --repo {url(mirror)} | {sys.executable} -c "
                         "\"import sys, json; print(sum(json.loads(l)['status'] == 'published' for l in sys.stdin))\"",
                         shell=True, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "2\n", out.stderr
    assert "published checkpoint-000002" in out.stderr  # logs go to stderr


# --------------------------------------------------------------------------- a real opd-train run


@pytest.fixture(scope="module")
def real_run(tiny_model, tmp_path_factory) -> Path:
    """opd-rollout -> opd-train (sft, 2 steps, a checkpoint each) on the tiny model."""
    from test_rollout import rollout
    from test_train import base_args, train

    recs = ok(rollout(tiny_model, "-n", "2", "--max-tokens", "6", "--limit", "4", "aime24")).stdout_bytes
    run_dir = tmp_path_factory.mktemp("real") / "run"
    ok(train(*base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "2", "--batch-size", "4",
                        "--save-every", "1"), input=recs))
    return run_dir


@pytest.mark.slow
def test_real_run_push_pull_loads_with_peft(real_run, tiny_model, tmp_path):
    """push -> pull: the pulled adapter loads with peft and equals the run's; the card shows the run's real loss."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    mirror = tmp_path / "mirror"
    out = records(ok(publish("push", str(real_run), "--repo", url(mirror), "--with-resume-state")))
    assert [r["status"] for r in out] == ["published"] * 3
    loss = json.loads((real_run / "metrics.jsonl").read_text().splitlines()[1])["loss"]
    assert f"| 2 | {loss:.6g} |" in (mirror / "README.md").read_text()
    dest = tmp_path / "pulled"
    ok(publish("pull", url(mirror), str(dest), "--checkpoint", "2"))
    ok(publish("verify", url(mirror), "--local", str(real_run)))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    model = PeftModel.from_pretrained(base, str(dest))
    theirs = load_file(str(real_run / "checkpoint-000002" / "adapter_model.safetensors"))
    mine = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(mine) == len(theirs) > 0
    for key, value in theirs.items():
        match = [v for k, v in mine.items() if k.replace(".default", "").endswith(key.split("base_model.model.")[-1])]
        assert len(match) == 1 and torch.equal(match[0], value), key
