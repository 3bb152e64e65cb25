"""benchmarks/bench_loop_gpu.py keeps working: the same script, on CPU with tiny models (GPU figures come
from running it on a GPU machine; docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.vllm
def test_the_loop_benchmark_measures_each_stage_of_each_run(tmp_path):
    """Also: a run that cannot run (here `:mps`, NVIDIA's Multi-Process Service, on a machine without it) is
    reported as failed, the runs after it still run, and the script exits 1."""
    out = tmp_path / "loop.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_loop_gpu.py"), "--tiny", "--runs",
                           "opsd:hf:1:mps,opsd:hf:1,opd:vllm:1", "--steps", "3", "--warmup", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [r["run"] for r in figures["results"]] == ["opsd:hf:1:mps", "opsd:hf:1", "opd:vllm:1"]
    assert "needs nvidia-cuda-mps-control" in figures["results"].pop(0)["error"]
    assert figures["machine"]["host"]["logical_cpus"] == os.cpu_count()
    assert (figures["machine"]["gpu"] is None) == (shutil.which("nvidia-smi") is None)
    for r in figures["results"]:
        assert r["steps_measured"] == 2 and r["completion_tokens"] > 0
        lo, hi = r["window"]  # the measured steps' wall-clock span, which gpu_during_window summarises
        assert hi - lo == pytest.approx(r["wall_s"], abs=0.01)
        assert r["completion_tokens_per_s"] == pytest.approx(r["completion_tokens"] / r["wall_s"], rel=0.01)
        split = r["split_seconds_per_step"]
        for key in ("rollout_decoding", "training", "policy_share"):  # every step hands its adapter over
            assert 0 < split[key] <= r["seconds_per_step"] + 0.01, (r["run"], key)
        for key in ("checkpoint_snapshot", "checkpoint_write_background"):  # --save-every 10: none in the window
            assert 0 <= split.get(key, 0) <= r["seconds_per_step"] + 0.01, (r["run"], key)
        assert r["rollout"]["decode_tokens_per_s"] > 0
    assert "scoring" in figures["results"][1]["split_seconds_per_step"]  # the external teacher's stage
    for r in figures["results"]:  # fkl reports them, with the in-trainer teacher and with top-16 records
        assert 0.5 < r["importance_ratio"]["mean"] < 2, r["run"]
        assert 0 <= r["drift"]["mean"] <= r["drift"]["max"] < 1, r["run"]
    assert "| opsd:hf:1 |" in done.stdout


def test_a_run_whose_module_is_missing_is_refused_before_anything_starts(tmp_path):
    """A dapo run needs math_verify (its rewards), a vllm run vllm: the script says so in one line at once, not
    after minutes of model writing and engine starts (a device lease spent that way once). Here math_verify is
    hidden by a meta-path finder placed before Python's own."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'math_verify':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_loop_gpu.py"), "--tiny",
                          "--runs", "opsd:hf:0,dapo:hf:1", "--keep", str(tmp_path / "work")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--runs opsd:hf:0,dapo:hf:1 needs math_verify, not installed here" in out.stderr
    assert not (tmp_path / "work").exists()  # nothing written
