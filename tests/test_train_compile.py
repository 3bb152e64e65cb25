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
        response = rng.integers(0, vocab, t)
        ids[2, 0] = response[2]  # a sampled token among the teacher's ids (fkl's ratio reads it)
        tokens = {"fkl": {"ids": ids, "teacher_logp": topk.astype(np.float32),
                          "behaviour_logp": -rng.random(t).astype(np.float32) * 3},
                  "rkl": {"behaviour_logp": -rng.random(t).astype(np.float32) * 3,
                          "teacher_logp": -rng.random(t).astype(np.float32) * 3,
                          "advantage": rng.standard_normal(t).astype(np.float32)},
                  "shift": {"ids": rng.integers(0, vocab, (t, K)),
                            "delta": rng.standard_normal((t, K)).astype(np.float32)},
                  "sft": {}, "grpo": {"behaviour_logp": -rng.random(t).astype(np.float32) * 3,
                           "advantage": np.full(t, rng.standard_normal(), np.float32)}}[loss]
        out.append(Example(id=str(i), prompt_id=str(i), prompt_ids=rng.integers(0, vocab, p),
                           response_ids=response, tokens=tokens))
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
    ("fkl", {"gradient_checkpointing": True}),  # each compiled layer recomputed in the backward
], ids=["fkl-tail", "fkl-tail-tau", "fkl-topk-tau", "rkl", "sft", "grpo", "shift", "fkl-checkpointing"])
def test_compiled_chunk_loss_matches_eager(tiny_model, loss, options):
    """fkl's compacted logits hold the sampled token as one more column for its ratio metric: the loss, tail
    and gradient stay those of the full vocabulary, and the ratio is that of the eager path."""
    torch._dynamo.reset()
    eager_metrics, eager_grads = step(str(tiny_model), loss, False, **options)
    compiled_metrics, compiled_grads = step(str(tiny_model), loss, True, **options)
    assert compiled_metrics.keys() == eager_metrics.keys()
    if loss in ("fkl", "rkl", "grpo"):
        assert "ratio" in eager_metrics and "drift" in eager_metrics
    for key, value in eager_metrics.items():
        assert compiled_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert compiled_grads.keys() == eager_grads.keys()
    for name, g in eager_grads.items():
        assert float(g.abs().max()) > 0, name
        assert float((compiled_grads[name] - g).abs().max()) <= 1e-4 * float(g.abs().max()) + 1e-7, name


def opsd_examples(rng, vocab: int, sizes: list[tuple[int, int, int]]) -> list[Example]:
    """OPSD-shaped examples (fkl with the in-trainer teacher): (prompt, response, teacher prompt) lengths."""
    return [Example(id=str(i), prompt_id=str(i), prompt_ids=rng.integers(0, vocab, p),
                    response_ids=rng.integers(0, vocab, t), teacher_context=rng.integers(0, vocab, q),
                    tokens={"behaviour_logp": -rng.random(t).astype(np.float32)})
            for i, (p, t, q) in enumerate(sizes)]


@pytest.mark.slow
def test_compiled_student_stops_compiling_after_warm_up(tiny_model, monkeypatch):
    """--compile on the OPSD step (student forward with gradients, base-weights teacher forward without): no
    graph breaks, and once both grad modes and both batch regimes (one sequence, several) have been seen, new
    lengths, widths and batch sizes compile nothing (a bounded set of graphs). Before, every decoder layer broke
    its graph at SDPA's is_causal (a SymBool) and was compiled on its own per shape and grad mode until
    torch.compile's recompile limit sent it to eager. Dynamo's graphs do not depend on the backend: the eager
    one keeps this fast."""
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", **kw))
    torch._dynamo.reset()
    counters.clear()
    config = TrainConfig(model=str(tiny_model), out="unused", loss="fkl", self_teacher="{problem}", max_steps=1,
                         lora_r=4, lora_alpha=8, batch_size=4, compile=True, logit_chunk=16)
    student = Student(config, "cpu")
    vocab = student.head.weight.shape[0]
    rng = np.random.default_rng(0)

    def micro_step(sizes):
        exs = opsd_examples(rng, vocab, sizes)
        student.micro_step(exs, sum(len(e.response_ids) for e in exs), 0.0)
        return counters["stats"]["unique_graphs"]

    # warm-up: both batch regimes of the decoder (several sequences, one: 0/1 sizes are always specialized)
    # and of the LM-head chunks (16 positions, fewer, one)
    micro_step([(9, 20, 30), (12, 7, 41)])
    micro_step([(5, 33, 25), (7, 12, 38), (20, 3, 60)])
    warm = micro_step([(11, 17, 35)])
    after = [micro_step(sizes) for sizes in ([(30, 40, 150), (6, 9, 20)], [(8, 61, 44)],
                                             [(4, 5, 9), (17, 28, 130), (9, 9, 9), (3, 50, 70)])]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert after == [warm] * 3, f"graphs after warm-up {warm}, then {after}"
    assert warm <= 12  # the layers share their graphs (compile_decoder): 11 here, whatever the layer count
