"""Every console script answers --help quickly, opening with a pipe example; unbuilt tools refuse."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

BUILT = ["opd-rollout", "opd-score", "opd-train", "opd-eval", "opd-cat"]
UNBUILT = ["opd-publish"]


def _script(name: str) -> str:
    return str(__import__("pathlib").Path(sys.executable).with_name(name))


@pytest.mark.parametrize("tool", BUILT + UNBUILT)
def test_help_is_fast_and_says_what_it_does(tool):
    t0 = time.perf_counter()
    out = subprocess.run([_script(tool), "--help"], capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Usage: ")
    assert seconds < 5, f"{tool} --help took {seconds:.1f} s (heavy imports at module level?)"
    if tool in BUILT:
        assert "|" in out.stdout.split("Options:")[0], "help should open with a pipe example"
    else:
        assert "NOT BUILT YET" in out.stdout


@pytest.mark.parametrize("tool", UNBUILT)
def test_unbuilt_tools_refuse_to_run(tool):
    out = subprocess.run([_script(tool), "--model", "x"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.startswith(f"Error: {tool} is not built yet (")
    assert out.stderr.strip().endswith("it does nothing")
