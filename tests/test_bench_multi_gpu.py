"""benchmarks/bench_multi_gpu.py (the issue-8 GPU runs in one command) works, on CPU with tiny shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # four trainer runs, two of them 2-process launches: ~50 s on 2 cores
def test_multi_gpu_benchmark_runs_and_reports_equivalence_on_cpu(tmp_path):
    out = tmp_path / "multi.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_multi_gpu.py"), "--tiny", "--gpus", "2",
                           "--work", str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(done.stdout) == report
    runs = report["runs"]
    assert list(runs) == ["one", "again", "ddp", "fsdp"]
    assert [runs[k]["gpus"] for k in runs] == [1, 1, 2, 2]
    for kind in ("again", "ddp", "fsdp"):
        vs = runs[kind]["vs_one"]
        assert len(vs["per_step"]) == 3
        # on CPU in fp32 the runs agree to float tolerance (2 ranks: a different summation order)
        assert vs["max_rel_loss"] < 1e-5 and vs["max_rel_grad_norm"] < 1e-5 and vs["max_rel_adapter"] < 1e-4, vs
    assert runs["again"]["vs_one"]["max_rel_adapter"] == 0.0  # one process on CPU is bit-exact run to run
    assert runs["ddp"]["scaling_efficiency"] > 0 and "scaling_efficiency" not in runs["again"]
