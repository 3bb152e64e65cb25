"""benchmarks/machine.py reads nvidia-smi's CSV as nvidia-smi writes it (a stand-in script speaks its
query protocol here: no GPU on this machine) and does without it where it is missing."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# `nvidia-smi --query-gpu=timestamp,... --format=csv,noheader,nounits -lms N`: a line every N ms until killed;
# fields that a card does not report are "[N/A]". Without -lms: one line of the queried limits.
FAKE_NVIDIA_SMI = """#!{python}
import sys, time
from datetime import datetime
args = sys.argv[1:]
if "-lms" not in args:
    print("NVIDIA H100 80GB HBM3, 580.82.07, 1980, 2619, 700.00")
    sys.exit(0)
every = int(args[args.index("-lms") + 1]) / 1000
i = 0
while True:
    stamp = datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    power = "[N/A]" if i % 4 == 3 else f"{{300 + 10 * (i % 3)}}.00"
    print(f"{{stamp}}, {{1000 + 100 * (i % 3)}}, 2619, {{power}}, 45, 87", flush=True)
    i += 1
    time.sleep(every)
"""


@pytest.fixture()
def machine():
    spec = importlib.util.spec_from_file_location("machine", ROOT / "benchmarks" / "machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def fake_smi(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text(FAKE_NVIDIA_SMI.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    return script


def test_gpu_limits_are_parsed_from_the_query_line(machine, fake_smi):
    assert machine.gpu() == {"name": "NVIDIA H100 80GB HBM3", "driver_version": "580.82.07",
                             "clocks.max.sm": 1980.0, "clocks.max.mem": 2619.0, "power.limit": 700.0}


def test_samples_are_summarised_over_the_window_only_and_the_sampler_stops(machine, fake_smi, tmp_path):
    t0 = time.time()
    with machine.GpuSampler(tmp_path / "gpu.csv", every_ms=40) as sampler:
        time.sleep(1.5)
    t1 = time.time()
    assert sampler._proc.poll() is not None  # nvidia-smi -lms runs until killed: the sampler ends it
    lines = (tmp_path / "gpu.csv").read_text().splitlines()
    assert len(lines) >= 8
    during = sampler.summary(t0 - 1, t1 + 1)
    assert during["samples"] == len(lines)
    clocks = sorted(1000 + 100 * (i % 3) for i in range(len(lines)))
    powers = sorted(300 + 10 * (i % 3) for i in range(len(lines)) if i % 4 != 3)  # "[N/A]" left out
    assert during["median_clocks.sm"] == pytest.approx((clocks[(len(clocks) - 1) // 2] + clocks[len(clocks) // 2]) / 2)
    assert during["median_power.draw"] == pytest.approx((powers[(len(powers) - 1) // 2] + powers[len(powers) // 2]) / 2)
    assert during["median_utilization.gpu"] == 87
    assert sampler.summary(t0 - 60, t0 - 30) is None  # no sample before the block began
    first, second = sampler.summary(t0 - 1, (t0 + t1) / 2), sampler.summary((t0 + t1) / 2, t1 + 1)
    assert 0 < first["samples"] < during["samples"] and first["samples"] + second["samples"] == during["samples"]


def test_without_nvidia_smi_the_gpu_parts_are_none(machine, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine.gpu() is None
    with machine.GpuSampler(tmp_path / "gpu.csv") as sampler:
        pass
    assert sampler.summary(0, time.time()) is None
    facts = machine.host()
    assert facts["logical_cpus"] == os.cpu_count() and 1 <= facts["usable_cpus"] <= os.cpu_count()
