"""An opd-train checkpoint is a LoRA adapter that vLLM's LoRARequest serves exactly as peft does."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from test_rollout import BIN, assert_aligned, chosen, load_model, ok, parse, rollout, teacher_forced_logits
from test_train import base_args, train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_trained_checkpoint_serves_in_vllm_like_peft(tiny_model, tmp_path):
    import torch

    recs = ok(rollout(tiny_model, "-n", "2", "--max-tokens", "12", "--limit", "4", "aime24")).stdout_bytes
    (tmp_path / "recs.jsonl").write_bytes(recs)
    run_dir = tmp_path / "run"
    ok(train(*base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "4", "--batch-size", "2", "--lr", "2e-2"),
             str(tmp_path / "recs.jsonl")))
    checkpoint = run_dir / (run_dir / "latest").read_text().strip()
    done = subprocess.run([str(BIN / "opd-rollout"), "--model", str(tiny_model), "--engine", "vllm",
                           "--eager", "--quiet",
                           "--adapter", str(checkpoint), "-n", "2", "--max-tokens", "16", "--temperature", "0.7",
                           "--top-k", "20", "--topk-logprobs", "5", "--limit", "2", "aime24"],
                          capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    served = parse(done.stdout)
    assert len(served) == 4
    assert all(r["policy"]["adapter"] == str(checkpoint) and r["policy"]["version"] == 4 for r in served)
    assert_aligned(load_model(tiny_model, checkpoint), served, k=5, top_k=20)  # vLLM + LoRA == peft, 1e-4
    base = load_model(tiny_model)
    gap = max(float(np.abs(chosen(torch.log_softmax(teacher_forced_logits(base, r), -1), r) - r["logprobs"]).max())
              for r in served)
    assert gap > 0.05  # the trained adapter really changes the model vLLM serves
