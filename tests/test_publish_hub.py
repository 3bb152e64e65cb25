"""opd-publish against hf:// targets: huggingface_hub's real HfApi/hf_hub_download, pointed by
HF_ENDPOINT at the Hub-compatible server in hub_server.py on loopback. Same guarantees as file://:
verified before indexed, immutable, faults detected and reported."""

from __future__ import annotations

import json

import pytest
import test_publish
from hub_server import HubServer
from test_publish import error_of, make_run, ok, publish, records

real_run = test_publish.real_run  # the module-scoped fixture: a real opd-train run dir

TOKEN = "hf_opdTestSecretToken123"
INDEX = "checkpoint_index.json"


@pytest.fixture(scope="module")
def server():
    with HubServer() as hub:
        yield hub


@pytest.fixture
def hub(server, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest sets HF_HUB_OFFLINE=1 for model loading
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # LFS files by the LFS protocol, not Xet
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    server.state.fail_commit = lambda summary: False
    return server


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path / "run")


_names = iter(range(1000))


@pytest.fixture
def repo():
    return f"org/run{next(_names)}"


def remote_index(hub, repo: str) -> dict:
    return json.loads(hub.state.files(repo, "main")[INDEX])


def test_push_verify_pull_through_the_real_client(hub, run, repo, tmp_path):
    result = ok(publish("push", str(run), "--repo", f"hf://{repo}", "--with-resume-state", "--private"))
    assert [r.get("status") for r in records(result)] == ["published", "published", "published"]
    assert TOKEN not in result.stdout + result.stderr
    assert hub.state.authorizations == {f"Bearer {TOKEN}"}  # HF_TOKEN is sent, never printed
    files = hub.state.files(repo, "main")
    assert sorted(p for p in files if p.startswith("checkpoint-000002/")) == [
        "checkpoint-000002/adapter_config.json", "checkpoint-000002/adapter_model.safetensors",
        "checkpoint-000002/sha256sums.txt", "checkpoint-000002/tokenizer.json", "checkpoint-000002/trainer_state.json"]
    assert files["latest-resume/trainer_state.pt"] == (run / "checkpoint-000002" / "trainer_state.pt").read_bytes()
    assert hub.state.repos[repo]["private"]
    index = remote_index(hub, repo)
    assert [e["step"] for e in index["checkpoints"]] == [1, 2]
    assert index["checkpoints"][0]["commit"] in hub.state.commits  # the commit where the folder landed
    assert "| 2 | 0.25 | 0.125 | 1 | 32 | `" in files["README.md"].decode()
    assert f"PeftModel.from_pretrained(base, '{repo}', subfolder='checkpoint-000002')" in files["README.md"].decode()
    seen = {r.split(" ")[0] + " " + r.split("/")[-2] for r in hub.state.requests if "/api/models/" in r}
    assert {"POST preupload", "POST commit", "GET tree"} <= seen
    assert any(r.startswith("HEAD /" + repo + "/resolve/") for r in hub.state.requests)
    assert f"POST /{repo}.git/info/lfs/objects/batch" in hub.state.requests  # the adapter went by LFS
    assert any(r.startswith("PUT /lfs/upload/") for r in hub.state.requests)
    assert not any(r.startswith("GET /") and r.endswith(".safetensors") for r in hub.state.requests), \
        "LFS files are verified from the Hub's sha256 metadata, not downloaded"
    again = records(ok(publish("push", str(run), "--repo", repo)))  # plain ORG/NAME means the Hub
    assert [r["status"] for r in again] == ["unchanged", "unchanged"]
    assert [r["ok"] for r in records(ok(publish("verify", f"hf://{repo}", "--local", str(run))))] == [True] * 3
    dest = tmp_path / "pulled"
    assert records(ok(publish("pull", f"hf://{repo}", str(dest), "--checkpoint", "1")))[0]["files"] == 4
    assert ((dest / "adapter_model.safetensors").read_bytes()
            == (run / "checkpoint-000001" / "adapter_model.safetensors").read_bytes())


def test_revision_branch(hub, run, repo):
    ok(publish("push", str(run), "--repo", f"hf://{repo}", "--revision", "dev", "--checkpoints", "latest"))
    assert INDEX not in hub.state.files(repo, "main")
    assert [e["step"] for e in json.loads(hub.state.files(repo, "dev")[INDEX])["checkpoints"]] == [2]
    ok(publish("verify", f"hf://{repo}", "--revision", "dev"))


def test_corrupted_remote_file_is_detected(hub, run, repo, tmp_path):
    ok(publish("push", str(run), "--repo", f"hf://{repo}"))
    hub.state.corrupt(repo, "checkpoint-000002/adapter_model.safetensors", b"\x00" * 1000)
    result = publish("verify", f"hf://{repo}")
    assert error_of(result).startswith(f"Error: hf://{repo} failed verification: "
                                       "checkpoint-000002/adapter_model.safetensors has sha256 ")
    assert [r["ok"] for r in records(result)] == [True, False]
    assert "(corrupted on the target); nothing was written to DIR" in error_of(
        publish("pull", f"hf://{repo}", str(tmp_path / "p"), "--checkpoint", "2"))
    assert not (tmp_path / "p").exists()


def test_failed_upload_then_resumed(hub, run, repo):
    hub.state.fail_commit = lambda summary: summary == "Add checkpoint-000002"
    err = error_of(publish("push", str(run), "--repo", f"hf://{repo}"))
    assert err.startswith(f"Error: hf://{repo}: upload of checkpoint-000002 failed (")
    assert err.endswith("nothing unverified was added to checkpoint_index.json; run the same push again to resume\n")
    assert TOKEN not in err
    assert [e["step"] for e in remote_index(hub, repo)["checkpoints"]] == [1]
    hub.state.fail_commit = lambda summary: False
    assert [r["status"] for r in records(ok(publish("push", str(run), "--repo", f"hf://{repo}")))] == [
        "unchanged", "published"]


def test_interrupted_push_is_completed(hub, run, repo):
    """checkpoint-000002/ landed in part (a commit without the index update): a re-push completes it."""
    from huggingface_hub import CommitOperationAdd, HfApi

    ok(publish("push", str(run), "--repo", f"hf://{repo}", "--checkpoints", "1"))
    half = (run / "checkpoint-000002" / "adapter_model.safetensors").read_bytes()[:300]
    HfApi(endpoint=hub.endpoint).create_commit(repo, [
        CommitOperationAdd("checkpoint-000002/adapter_model.safetensors", half)], commit_message="partial")
    assert [r["path"] for r in records(ok(publish("verify", f"hf://{repo}")))] == ["checkpoint-000001"]
    assert [r["status"] for r in records(ok(publish("push", str(run), "--repo", f"hf://{repo}")))] == [
        "unchanged", "published"]
    ok(publish("verify", f"hf://{repo}", "--local", str(run)))


def test_push_interrupted_between_upload_and_index(hub, run, repo):
    """The folder landed and verified but the index commit failed: not published; a re-push indexes it."""
    hub.state.fail_commit = lambda summary: summary.startswith("Index checkpoint-000002")
    assert "writing checkpoint_index.json failed" in error_of(publish("push", str(run), "--repo", f"hf://{repo}"))
    assert "checkpoint-000002/sha256sums.txt" in hub.state.files(repo, "main")
    assert [e["step"] for e in remote_index(hub, repo)["checkpoints"]] == [1]
    landed = hub.state.repos[repo]["branches"]["main"]
    hub.state.fail_commit = lambda summary: False
    out = records(ok(publish("push", str(run), "--repo", f"hf://{repo}")))
    assert [r["status"] for r in out] == ["unchanged", "published"]
    assert out[1]["commit"] == landed  # nothing re-uploaded: the commit that holds the folder
    ok(publish("verify", f"hf://{repo}", "--local", str(run)))


def test_different_content_under_published_step(hub, run, repo):
    ok(publish("push", str(run), "--repo", f"hf://{repo}", "--checkpoints", "1"))
    (run / "checkpoint-000001" / "adapter_config.json").write_text('{"r": 4}')
    err = error_of(publish("push", str(run), "--repo", f"hf://{repo}"))
    assert err.startswith(f"Error: hf://{repo}: checkpoint-000001 is already published with different content")
    assert hub.state.files(repo, "main")["checkpoint-000001/adapter_config.json"] == b'{"r": 8}'


def test_missing_repo_is_a_clear_error(hub, tmp_path):
    assert error_of(publish("verify", "hf://org/nothing-here")) == (
        f"Error: hf://org/nothing-here: no such repo or revision at {hub.endpoint} (nothing was published there, "
        "or HF_TOKEN cannot read it)\n")
    assert error_of(publish("push", str(tmp_path), "--repo", "hf://org")) == (
        "Error: --repo 'hf://org': a Hub repo is ORG/NAME (e.g. hf://my-org/qwen3-opd-run1)\n")


@pytest.mark.slow
def test_real_run_push_pull_then_opd_eval(hub, real_run, tiny_model, repo, tmp_path):
    """A real opd-train run through the Hub: pull + opd-eval works on what push sent."""
    from click.testing import CliRunner

    from opd_eval.cli import command as eval_main
    from opd_eval.results import adapter_identity

    ok(publish("push", str(real_run), "--repo", f"hf://{repo}", "--checkpoints", "latest", "--quiet"))
    dest = tmp_path / "pulled"
    ok(publish("pull", f"hf://{repo}", str(dest), "--checkpoint", "latest"))
    out = tmp_path / "eval.json"
    ok(CliRunner().invoke(eval_main, ["run", "--model", str(tiny_model), "--adapter", str(dest), "--engine", "hf",
                                      "--bench", "aime24", "--limit", "1", "-n", "1", "--max-tokens", "4",
                                      "--grade-workers", "1", "--quiet", "--out", str(out)]))
    res = json.loads(out.read_text())
    assert res["adapter"]["step"] == 2
    assert res["adapter"]["sha256"] == adapter_identity(str(real_run / "checkpoint-000002"), 2, None)["sha256"]
