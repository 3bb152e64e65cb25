"""End to end with vLLM on CPU: `opd-eval run` on aime24 (n=2) for the tiny base model and for a
checkpoint of an opd-train-style run directory, then `compare` and `report` on the results files.

vLLM spawns engine processes, so everything runs through the console script in subprocesses; the
two evaluations start together (one module fixture) because an engine start costs 20-40 s here.
"""

from __future__ import annotations

import json
import subprocess

import orjson
import pytest
from test_rollout import BIN, make_lora_adapter

from opd_common.engines import derive_seed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ARGS = ["--engine", "vllm", "--eager", "--bench", "aime24", "--limit", "4", "-n", "2", "--max-tokens", "24",
        "--temperature", "1.0", "--grade-workers", "1", "--quiet"]
IDS = ["aime24-I-1", "aime24-I-2", "aime24-I-3", "aime24-I-4"]


@pytest.fixture(scope="module")
def evals(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval-vllm")
    run_dir = tmp / "run"
    ckpt = make_lora_adapter(tiny_model, run_dir / "checkpoint-000010", scale=0.2)
    (ckpt / "trainer_state.json").write_text('{"step": 10}\n')
    (run_dir / "latest").write_text("checkpoint-000010\n")
    results = tmp / "results"
    common = [str(BIN / "opd-eval"), "run", "--model", str(tiny_model), *ARGS]
    commands = {
        "base": [*common, "--out", str(results / "step0.json")],
        "step10": [*common, "--run-dir", str(run_dir), "--checkpoint", "latest", "--out", str(results / "step10.json")],
    }
    procs, out = {}, {"tmp": tmp, "results": results, "run_dir": run_dir}
    for name, cmd in commands.items():
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, stderr.decode()[-3000:]
            out[name] = (stdout.decode(), stderr.decode())
    finally:
        for proc in procs.values():
            proc.kill()
    return out


def test_results_files_are_complete_and_consistent(evals, tiny_model):
    results = evals["results"]
    base = orjson.loads((results / "step0.json").read_bytes())
    step10 = orjson.loads((results / "step10.json").read_bytes())
    assert sorted(p.name for p in results.iterdir()) == ["step0.json", "step10.json"]  # no progress files left
    for res in (base, step10):
        assert res["engine"] == "vllm"
        assert [(r["prompt_id"], r["sample"]) for r in res["samples"]] == [(i, s) for i in IDS for s in (0, 1)]
        assert all(r["seed"] == derive_seed(0, r["prompt_id"], r["sample"]) for r in res["samples"])
        assert all(1 <= r["length"] <= 24 and r["correct"] == (r["reason"] == "match") for r in res["samples"])
        assert res["metrics"]["overall"]["samples"] == 8 and res["metrics"]["overall"]["n"] == 2
        assert set(res["metrics"]["overall"]["pass_at_k"]) == {"1", "2"}
    assert base["step"] == 0 and base["adapter"] is None
    assert step10["step"] == 10
    assert step10["adapter"]["path"] == str(evals["run_dir"] / "checkpoint-000010")
    assert step10["adapter"]["run_dir"] == str(evals["run_dir"]) and len(step10["adapter"]["sha256"]) == 64
    assert base["model"]["sha256"] == step10["model"]["sha256"]
    assert base["benchmark"] == step10["benchmark"]
    # the adapter changes what is sampled (same prompts, same per-sample seeds)
    texts = lambda res: [r["response_text"] for r in res["samples"]]  # noqa: E731
    assert texts(base) != texts(step10)
    # stdout: one JSON line each; the table went to stderr
    assert json.loads(evals["base"][0])["avg"] == base["metrics"]["overall"]["avg"]
    assert "avg@2" in evals["base"][1]


def test_compare_reads_the_results(evals):
    results = evals["results"]
    done = subprocess.run([str(BIN / "opd-eval"), "compare", str(results / "step0.json"), str(results / "step10.json"),
                           "--resamples", "1000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [c] = json.loads(done.stdout)["comparisons"]
    base = orjson.loads((results / "step0.json").read_bytes())["metrics"]["overall"]["avg"]
    step10 = orjson.loads((results / "step10.json").read_bytes())["metrics"]["overall"]["avg"]
    assert c["problems"] == 4 and c["diff"] == pytest.approx(step10 - base)
    assert c["ci"][0] <= c["diff"] <= c["ci"][1] and 0 < c["p_value"] <= 1
    assert c["wins"] + c["losses"] + c["ties"] == 4


def test_report_writes_markdown_and_a_png_that_opens(evals):
    from PIL import Image

    results = evals["results"]
    out = evals["tmp"] / "report"
    done = subprocess.run([str(BIN / "opd-eval"), "report", str(results), "--out", str(out), "--resamples", "1000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    md = (out / "report.md").read_text()
    assert done.stdout == md + "\n"
    assert "## aime24" in md and "| 0 | step0.json |" in md and "| 10 | step10.json |" in md
    with Image.open(out / "accuracy.png") as img:
        img.load()
        assert img.format == "PNG" and img.size == (768, 480)
