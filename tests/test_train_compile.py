"""--compile's LM head + loss (one torch.compile'd function per position chunk) against the eager path:
same loss, metrics and adapter gradients on the tiny model (CPU, inductor backend)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opd_train.config import TrainConfig
from opd_train.data import Example
from opd_train.model import Student

K = 4


def examples(vocab: int, loss: str, seed: int = 0) -> list[Example]:
    """Three records of different lengths with the per-token fields that `loss` reads."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, t) in enumerate([(5, 9), (3, 13), (7, 6)]):
        logits = rng.standard_normal((t, K)).astype(np.float32)
        topk = logits - np.log(np.exp(logits).sum(1, keepdims=True)) - 0.7  # K ids hold ~half the mass
        ids = rng.integers(0, vocab, (t, K))
        ids[0, 1] = ids[0, 3]  # a repeated id (the compacted logits keep its first occurrence)
        tokens = {"fkl": {"ids": ids, "teacher_logp": topk.astype(np.float32)},
                  "rkl": {"behaviour_logp": -rng.random(t).astype(np.float32) * 3,
                          "teacher_logp": -rng.random(t).astype(np.float32) * 3,
                          "advantage": rng.standard_normal(t).astype(np.float32)},
                  "shift": {"ids": rng.integers(0, vocab, (t, K)),
                            "delta": rng.standard_normal((t, K)).astype(np.float32)},
                  "sft": {}, "grpo": {"behaviour_logp": -rng.random(t).astype(np.float32) * 3,
                           "advantage": np.full(t, rng.standard_normal(), np.float32)}}[loss]
        out.append(Example(id=str(i), prompt_id=str(i), prompt_ids=rng.integers(0, vocab, p),
                           response_ids=rng.integers(0, vocab, t), tokens=tokens))
    return out


def step(model: str, loss: str, compile: bool, **options) -> tuple[dict, dict]:
    """Metrics and adapter gradients of one micro-step (LM head in uneven chunks of 8 positions),
    from an adapter whose weights are all random (LoRA's zero B would leave A's gradient zero)."""
    torch.manual_seed(0)
    batch = {"batch_groups": 1} if loss == "grpo" else {"batch_size": 3}
    config = TrainConfig(model=model, out="unused", loss=loss, max_steps=1, lora_r=4, lora_alpha=8, logit_chunk=8,
                         compile=compile, **batch, **options)
    student = Student(config, "cpu")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in student.params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    exs = examples(student.head.weight.shape[0], loss)
    num_tokens = sum(len(e.response_ids) for e in exs)
    metrics = student.micro_step(exs, num_tokens, beta=1.7)
    grads = {n: p.grad.clone() for n, p in student.peft.named_parameters() if p.requires_grad}
    return metrics, grads


@pytest.mark.slow
@pytest.mark.parametrize("loss, options", [
    ("fkl", {}),
    ("fkl", {"loss_temperature": 1.5}),
    ("fkl", {"fkl_tail": False, "loss_temperature": 1.1}),
    ("rkl", {"ratio_clip": 1.5}),
    ("sft", {}),
    ("grpo", {"kl_coef": 0.1}),
    ("shift", {}),
], ids=["fkl-tail", "fkl-tail-tau", "fkl-topk-tau", "rkl", "sft", "grpo", "shift"])
def test_compiled_chunk_loss_matches_eager(tiny_model, loss, options):
    torch._dynamo.reset()
    eager_metrics, eager_grads = step(str(tiny_model), loss, False, **options)
    compiled_metrics, compiled_grads = step(str(tiny_model), loss, True, **options)
    assert compiled_metrics.keys() == eager_metrics.keys()
    for key, value in eager_metrics.items():
        assert compiled_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert compiled_grads.keys() == eager_grads.keys()
    for name, g in eager_grads.items():
        assert float(g.abs().max()) > 0, name
        assert float((compiled_grads[name] - g).abs().max()) <= 1e-4 * float(g.abs().max()) + 1e-7, name
