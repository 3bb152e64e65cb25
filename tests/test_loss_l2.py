"""--loss l2: the pure function against its equation, and one opd-train step with it."""

from __future__ import annotations

import json

import torch

from opd_train import losses as L
from test_rollout import ok
from test_train import base_args, scored, train  # noqa: F401 (the scored fixture)


def test_l2_value_gradient_and_zero_at_the_teacher():
    z = torch.randn(3, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = torch.tensor([1, 4, 6])
    t = torch.tensor([-1.0, -2.0, -0.5])
    out = L.l2(z, y, t, num_tokens=5)
    d = torch.log_softmax(z.detach(), -1)[torch.arange(3), y] - t
    assert torch.allclose(out.loss, (d * d).sum() / 10) and torch.equal(out.metrics["l2"], out.loss.detach())
    out.loss.backward()
    want = torch.zeros(3, 7)
    p = torch.softmax(z.detach(), -1)
    for n in range(3):  # d loss / d z_v = d_t ([v == y_t] - p_v) / #tokens
        want[n] = d[n] * (torch.nn.functional.one_hot(y[n], 7) - p[n]) / 5
    assert torch.allclose(z.grad, want, atol=1e-6)
    same = L.token_logprobs(z.detach(), y)
    assert float(L.l2(z.detach(), y, same, num_tokens=3).loss) == 0.0


def test_opd_train_loss_l2(scored, tiny_model, tmp_path):
    ok(train(*base_args(tiny_model, tmp_path / "run", "--loss", "l2", "--max-steps", "1", "--batch-size", "4"),
             str(scored)))
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert row["loss"] == row["l2"] > 0
