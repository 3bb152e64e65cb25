"""What a benchmark ran on, so that figures from two machines of one kind can be told apart.

H100 machines gave the same loop figures up to 23% apart (docs/benchmarks.md); these facts go into the
benchmark's JSON so that machines can be compared: the host's CPU and load, the GPU's limits, and the
GPU's clocks, power and temperature while a run was measured (``nvidia-smi --query-gpu ... -lms``,
sampled in the background). Without nvidia-smi (CPU machines) the GPU parts are None.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from datetime import datetime
from pathlib import Path

LIMITS = ("name", "driver_version", "clocks.max.sm", "clocks.max.mem", "power.limit")
SAMPLED = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "utilization.gpu")
TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's timestamp field, local time


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _number(text: str) -> float | None:
    """One nounits CSV value; '[N/A]', '[Not Supported]' and the like are None."""
    try:
        return float(text)
    except ValueError:
        return None


def _query(fields: tuple[str, ...], *extra: str) -> list[str]:
    """nvidia-smi's argv for GPU 0's `fields`, one CSV line of plain numbers each time it reports."""
    return ["nvidia-smi", "-i", "0", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", *extra]


def load_average() -> float:
    """The host's 1-minute load average."""
    return round(os.getloadavg()[0], 2)


def host() -> dict:
    return {"cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)), "load_average_1m": load_average()}


def gpu() -> dict | None:
    """GPU 0's name, driver and limits (MHz, W); None without nvidia-smi, {'error'} when it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(_query(LIMITS), capture_output=True, text=True, timeout=30)
    if done.returncode != 0 or not done.stdout.strip():
        return {"error": f"nvidia-smi exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    values = [v.strip() for v in done.stdout.splitlines()[0].split(",")]
    return {key: (value if key in ("name", "driver_version") else _number(value))
            for key, value in zip(LIMITS, values, strict=True)}


class GpuSampler:
    """``with GpuSampler(path): ...`` samples GPU 0 every ``every_ms`` into ``path`` while the block runs;
    ``summary(lo, hi)`` gives the median of each sampled field between two time.time() instants."""

    def __init__(self, path: Path, every_ms: int = 500):
        self.path, self.every_ms, self._proc, self._file = Path(path), every_ms, None, None

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi") is not None:
            self._file = open(self.path, "w")
            self._proc = subprocess.Popen(_query(("timestamp", *SAMPLED), "-lms", str(self.every_ms)),
                                          stdout=self._file, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._file.close()

    def summary(self, lo: float, hi: float) -> dict | None:
        """Medians over the samples taken in [lo, hi] and their count; None when none was taken."""
        columns: dict[str, list[float]] = {key: [] for key in SAMPLED}
        samples = 0
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            fields = [v.strip() for v in line.split(",")]
            if len(fields) != 1 + len(SAMPLED):
                continue
            try:
                at = datetime.strptime(fields[0], TIME_FORMAT).timestamp()
            except ValueError:
                continue
            if not lo <= at <= hi:
                continue
            samples += 1
            for key, value in zip(SAMPLED, fields[1:], strict=True):
                if (number := _number(value)) is not None:
                    columns[key].append(number)
        if samples == 0:
            return None
        return {"samples": samples, **{f"median_{key}": statistics.median(values) if values else None
                                       for key, values in columns.items()}}
