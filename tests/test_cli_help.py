"""Every console script answers --help quickly, opening with a pipe example."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

BUILT = ["opd-rollout", "opd-score", "opd-train", "opd-eval", "opd-cat", "opd-publish", "opd-check"]


def _script(name: str) -> str:
    return str(__import__("pathlib").Path(sys.executable).with_name(name))


@pytest.mark.parametrize("tool", BUILT)
def test_help_is_fast_and_says_what_it_does(tool):
    t0 = time.perf_counter()
    out = subprocess.run([_script(tool), "--help"], capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Usage: ")
    assert seconds < 5, f"{tool} --help took {seconds:.1f} s (heavy imports at module level?)"
    assert "|" in out.stdout.split("Options:")[0], "help should open with a pipe example"
