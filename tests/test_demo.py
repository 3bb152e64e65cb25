"""The main job (scripts/demo.sh, `make demo`): the demo world, the merge, the trainer's exit, and the
whole demo end to end (the student must improve with a paired CI excluding 0; GRPO raises reward)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from test_rollout import BIN

from opd_common.demo import build_world, merge, problems, sft_record
from opd_common.records import validate

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"hidden_size": 64, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate_size": 128}


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def small_world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.mktemp("world") / "w", n_train=300, n_test=50, **SMALL)


def test_problems_are_distinct_correct_and_split_without_overlap():
    train, test = problems(seed=3, digits=2, n_train=400, n_test=100)
    assert len(train) == 400 and len(test) == 100
    seen = set()
    for row in train + test:
        a, b = (int(x) for x in row["problem"].split("+"))
        assert 0 <= a < 100 and 0 <= b < 100 and row["answer"] == str(a + b)
        seen.add(row["problem"])
    assert len(seen) == 500  # no problem twice, so none in both train and test
    assert problems(seed=3, digits=2, n_train=400, n_test=100) == (train, test)
    assert problems(seed=4, digits=2, n_train=400, n_test=100) != (train, test)


def test_world_files_tokenizer_and_sft_records(small_world):
    from transformers import AutoTokenizer

    from opd_common.models import render_chat

    tok = AutoTokenizer.from_pretrained(small_world / "base")
    digits = tok("12345+678", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in digits] == list("12345+678")  # every digit its own token
    train, test = lines(small_world / "train.jsonl"), lines(small_world / "test.jsonl")
    assert (len(train), len(test)) == (300, 50)
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    sft = lines(small_world / "sft.jsonl")
    assert [r["prompt_id"] for r in sft] == [r["id"] for r in train]
    for row, rec in zip(train[:20], sft[:20], strict=True):
        validate(json.loads(json.dumps(rec)), "sft.jsonl")  # (validate turns lists into arrays in place)
        # the prompt opd-rollout --template '{problem}' --thinking off renders, so SFT trains on it
        assert rec["prompt_ids"] == list(render_chat(tok, row["problem"], thinking=False))
        assert rec["response_ids"][-1] == tok.eos_token_id
        assert tok.decode(rec["response_ids"][:-1]) == f"\\boxed{{{row['answer']}}}"
        assert rec["logprobs"] == [0.0] * len(rec["response_ids"])
    assert sft_record(tok, train[0]) == sft[0]
    config = json.loads((small_world / "base" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)


def test_merge_gives_the_logits_of_base_plus_adapter(small_world, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(small_world / "base", dtype=torch.float32)
    torch.manual_seed(0)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    merged_dir = merge(small_world / "base", tmp_path / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged.tmp").exists()
    ids = torch.tensor([[5, 17, 99, 250, 3, 8]])
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(small_world / "base", dtype=torch.float32), tmp_path / "adapter")
    plain = AutoModelForCausalLM.from_pretrained(small_world / "base", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        want, got, before = reference(ids).logits, merged(ids).logits, plain(ids).logits
    assert (want - before).abs().max() > 1e-2  # the adapter changes the model ...
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # ... and the merged folder has it


@pytest.mark.slow
def test_trainer_exits_0_after_its_budget_while_its_stdin_stays_open(small_world, tmp_path):
    """In a pipeline the upstream keeps stdin open: the trainer must end cleanly after --max-steps (it
    aborted with exit 134 at interpreter shutdown while its reader thread held stdin)."""
    cmd = [f"{BIN}/opd-train", "--model", str(small_world / "base"), "--loss", "sft", "--out", str(tmp_path / "run"),
           "--max-steps", "2", "--batch-size", "4", "--lora-r", "4", "--lora-alpha", "8", "--quiet"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        records = (small_world / "sft.jsonl").read_bytes().splitlines(keepends=True)
        # what 2 steps of 4 take, no EOF: the reader thread is left blocked in a read of stdin
        proc.stdin.write(b"".join(records[:8]))
        proc.stdin.flush()
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.stdin.close()
    err = proc.stderr.read().decode()
    assert rc == 0, err[-2000:]
    assert (tmp_path / "run" / "latest").read_text().strip() == "checkpoint-000002"
    assert "Traceback" not in err and "could not acquire lock" not in err


# ---- the whole demo ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """scripts/demo.sh at its defaults (the README's main job), once for the tests below."""
    out = tmp_path_factory.mktemp("demo") / "out"
    env = {**os.environ, "OPD_DEMO_OUT": str(out), "PATH": f"{BIN}:{os.environ['PATH']}"}
    done = subprocess.run([str(ROOT / "scripts" / "demo.sh")], capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done


@pytest.mark.slow
def test_demo_student_improves_with_a_ci_excluding_0(demo):
    out, done = demo
    comparison = json.loads((out / "eval" / "compare.json").read_text())["comparisons"][0]
    lo, hi = comparison["ci"]
    assert comparison["problems"] == 200
    assert comparison["diff"] > 0.10 and lo > 0, comparison
    assert comparison["avg_b"] - comparison["avg_a"] == pytest.approx(comparison["diff"])
    # the distillation run was strictly on-policy: step s trained on samples of checkpoint s - 1
    rows = lines(out / "distill" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 101))
    assert all(r.get("records_stale", 0) == 0 for r in rows)
    # what it prints: the gain with its CI (last stdout line), the report and its plot
    last = done.stdout.strip().splitlines()[-1]
    assert re.search(r"gain \+\d+\.\d points \(95% CI \+\d+\.\d to \+\d+\.\d, p = ", last), last
    assert (out / "eval" / "report.md").exists() and (out / "eval" / "accuracy.png").stat().st_size > 1000
    teacher = json.loads((out / "teacher-eval.json").read_text())["metrics"]["overall"]["avg"]
    assert teacher > comparison["avg_b"]  # the teacher is the ceiling the student moved toward
    check = (out / "check.txt").read_text()  # the preflight passed on the demo world before the distillation
    assert check.rstrip().splitlines()[-1].endswith(" 0 fail, 1 skipped"), check  # (adapter: none given)
    for name in ("tokenizers", "rendering", "logprobs", "self", "stops"):
        assert f"\nPASS  {name:<10}" in "\n" + check, (name, check)


@pytest.mark.slow
def test_grpo_on_the_demo_task_raises_its_reward(demo, tmp_path):
    """RL with the verifier reward, strictly on-policy, from the demo's student (32 prompts x 8 samples
    a step; with 8 prompts the reward only wandered): the mean reward of the last 10 steps' samples
    beats the first 10 steps' (measured: 0.26 -> 0.48 in 50 steps, about 2 minutes)."""
    out, _ = demo
    student, run, scored = out / "student", tmp_path / "grpo", tmp_path / "scored.jsonl"
    command = (
        f"{BIN}/opd-rollout --model {student} --engine hf --template '{{problem}}' --thinking off -n 8 "
        f"--temperature 1.0 --max-tokens 12 --batch-prompts 32 --follow {run} --max-lag 0 --quiet "
        f"{out / 'world' / 'train.jsonl'} | "
        f"{BIN}/opd-score --reward math --grader integer --quiet | tee {scored} | "
        f"{BIN}/opd-train --model {student} --loss grpo --out {run} --max-steps 50 --batch-groups 32 "
        f"--lora-r 32 --lora-alpha 64 --lora-targets all-linear --lr 1e-3 --save-every 1 --quiet")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    by_version: dict[int, list[float]] = {}
    for rec in lines(scored):
        by_version.setdefault(rec["policy"]["version"], []).append(rec["reward"]["total"])
    assert sorted(by_version) == list(range(50))  # version v = sampled by checkpoint v (0 = the student)
    first = [r for v in range(0, 10) for r in by_version[v]]
    last = [r for v in range(40, 50) for r in by_version[v]]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(last) > mean(first) + 0.10, (mean(first), mean(last))
