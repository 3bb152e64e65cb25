"""recipes/*.sh: each seed system's pipeline runs end to end on the tiny models (a few steps each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
BIN = Path(sys.executable).parent
STEPS = 2
TINY = ["--steps", str(STEPS), "--groups", "2", "--max-tokens", "8", "--engine", "hf",
        "--lora-r", "8", "--lora-alpha", "16", "--bin", str(BIN)]


def run_recipe(name: str, out: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", str(RECIPES / f"{name}.sh"), "--out", str(out), *TINY, *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def check_run(done: subprocess.CompletedProcess, out: Path, keys: list[str]) -> list[dict]:
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""  # opd-train prints nothing without --metrics-stdout; the pipe's records stay inside
    assert (out / "latest").read_text().strip() == f"checkpoint-{STEPS:06d}"
    assert (out / f"checkpoint-{STEPS:06d}" / "adapter_model.safetensors").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for key in keys:
            assert key in row, (key, row)
    return rows


def test_opsd(tiny_model, tmp_path):
    out = tmp_path / "run"
    rows = check_run(run_recipe("opsd", out, "--model", str(tiny_model)), out, ["fkl", "fkl_clipped_frac"])
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["loss"] == "fkl" and config["self_teacher"] == "opsd"
    assert config["kl_clip"] == 0.05 and config["loss_temperature"] == 1.1
    assert config["max_staleness"] == 2  # the recipe's --max-lag 2 (its header gives the measured cost)
    assert all(r["records"] == 2 for r in rows)  # 2 prompts x 1 sample


def test_direct_opd(tiny_model, tiny_teacher, tmp_path):
    out = tmp_path / "run"
    rows = check_run(run_recipe("direct-opd", out, "--model", str(tiny_model), "--post", str(tiny_teacher),
                                "--pre", str(tiny_model), "--group-size", "2"),
                     out, ["weighted_shift", "k3", "policy", "beta"])
    assert rows[0]["beta"] == 2.5


def test_direct_opd_takes_the_seeds_parquet(tiny_model, tiny_teacher, tmp_path):
    """--data opd_train.parquet in the seed's (verl's) layout: the rollout reads it as it is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "math", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(6)]
    data = tmp_path / "opd_train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "run"
    done = run_recipe("direct-opd", out, "--model", str(tiny_model), "--post", str(tiny_teacher),
                      "--pre", str(tiny_model), "--group-size", "2", "--data", str(data), "--no-check")
    check_run(done, out, ["weighted_shift", "k3"])
    rows[0]["prompt"] = [{"role": "system", "content": "no user turn"}]  # proof the recipe reads this file
    pq.write_table(pa.Table.from_pylist(rows), data)
    done = run_recipe("direct-opd", tmp_path / "run2", "--model", str(tiny_model), "--post", str(tiny_teacher),
                      "--pre", str(tiny_model), "--group-size", "2", "--data", str(data), "--no-check")
    assert done.returncode != 0
    assert ("Error: row 1 of opd_train.parquet: the conversation in 'prompt' has no user turn (roles: system)"
            in done.stderr), done.stderr[-2000:]


def test_dapo(tiny_model, tmp_path):
    """The tiny random model answers nothing right: every group is all-wrong, so dynamic sampling would drop
    them all (and the --follow loop would wait for input forever); the test turns it off."""
    out = tmp_path / "run"
    rows = check_run(run_recipe("dapo", out, "--model", str(tiny_model), "--group-size", "2", "--gen-factor", "2",
                                "--overlong-buffer", "4", "--extra-train", "--no-dynamic-sampling", "--no-check"),
                     out, ["pg", "k3", "clip_frac", "records_stale"])
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["kl_coef"] == 0.01 and config["loss"] == "dapo"
    assert all(r["ratio"] == pytest.approx(1.0, abs=1e-3) for r in rows)  # leftovers dropped: on-policy
    assert rows[1]["records_stale"] == 4  # batch 0 had 2 x 2 groups; step 1 took 2, step 2 dropped 2 (4 records)



def test_dapo_at_max_lag_1_trains_on_the_batch_before(tiny_model, tmp_path):
    """--max-lag 1 sets the trainer's --max-staleness to 1 too: step 2 trains on batch 0's leftover groups
    (sampled by the base, one step behind) instead of dropping them and waiting for a new batch."""
    out = tmp_path / "run"
    rows = check_run(run_recipe("dapo", out, "--model", str(tiny_model), "--group-size", "2", "--gen-factor", "2",
                                "--overlong-buffer", "4", "--max-lag", "1", "--extra-train", "--no-dynamic-sampling",
                                "--no-check"),
                     out, ["pg", "records_stale"])
    assert json.loads((out / "config.json").read_text())["config"]["max_staleness"] == 1
    assert [r["records_stale"] for r in rows] == [0, 0]
    assert [r["records_read"] for r in rows] == [4, 8]  # both steps from batch 0's 2 x 2 groups


def test_opd(tiny_model, tiny_teacher, tmp_path):
    out = tmp_path / "run"
    done = run_recipe("opd", out, "--model", str(tiny_model), "--teacher", str(tiny_teacher), "--group-size", "2")
    rows = check_run(done, out, ["reverse_kl", "advantage", "ratio"])
    assert all(r["ratio"] == pytest.approx(1.0, abs=1e-3) for r in rows)
    assert f"PASS  tokenizers --teacher t={tiny_teacher}: same 2048 ids" in done.stderr  # the preflight ran first
    assert "opd-check: " in done.stderr and " 0 fail, " in done.stderr


def test_a_failing_preflight_stops_the_recipe_before_any_training(tiny_model, tiny_teacher, tmp_path):
    import shutil

    other = shutil.copytree(tiny_teacher, tmp_path / "teacher")  # the same vocabulary, another chat template
    jinja = other / "chat_template.jinja"
    jinja.write_text(jinja.read_text().replace("<|im_start|>assistant", "<|im_start|>bot"))
    out = tmp_path / "run"
    done = run_recipe("opd", out, "--model", str(tiny_model), "--teacher", str(other), "--group-size", "2")
    assert done.returncode == 1 and done.stdout == ""
    assert f"FAIL  tokenizers --teacher t={other}: same 2048 ids; --teacher t={other}: chat templates differ at " \
           "line 1, column " in done.stderr
    assert done.stderr.rstrip().endswith("Error: opd-check found a mismatch (above); fix it, or skip the preflight "
                                         "with --no-check")
    assert not out.exists()  # no trainer ran


@pytest.mark.parametrize("name,missing", [("opd", "--teacher"), ("direct-opd", "--post")])
def test_required_flags(tmp_path, name, missing):
    done = run_recipe(name, tmp_path / "run")
    assert done.returncode != 0 and missing in done.stderr and done.stdout == ""


@pytest.mark.parametrize("name", ["opsd", "direct-opd", "dapo", "opd"])
def test_help_and_bad_flag(name):
    done = subprocess.run(["bash", str(RECIPES / f"{name}.sh"), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "Seed hyper-parameters" in done.stdout and "deviates" in done.stdout
    done = subprocess.run(["bash", str(RECIPES / f"{name}.sh"), "--out", "x", "--nope", "1"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "--nope" in done.stderr
