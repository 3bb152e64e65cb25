"""opd_train.losses GRPO / DAPO pieces (group_advantages, ppo_clip, dynamic_sampling_keep) against
references written here from the spec (docs/architecture.md "Objectives", `grpo` / `dapo`), independently of the
torch code: plain Python loops over small tensors (V = 6, N = 7) in float64, values, metrics and
gradients. Each ppo_clip token is placed (through its behaviour log-prob) in one regime of the
clipped objective, and the regimes are also asserted by hand. Plus the invariants: chunk
(micro-batch) invariance, on-policy ratio one, detached metrics and advantages, bf16 logits.

The DAPO overlong penalty (opd_common.grading.overlong_penalty) is covered by tests/test_grading.py
(below / at L_max - cache, inside the buffer, at and past L_max, None, hard cut, bad buffer)."""

from __future__ import annotations

import math

import pytest
import torch
from test_losses import assert_bf16_accepted, assert_chunks_add_up, close, leaf

from opd_train import losses as L

V = 6
CL, CH, C = 0.2, 0.28, 10.0  # the defaults: clip_low, clip_high, dual_clip


# --------------------------------------------------------------------------- references (plain python)


def log_softmax_row(z: list[float]) -> list[float]:
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def softmax_row(z: list[float]) -> list[float]:
    return [math.exp(x) for x in log_softmax_row(z)]


def rows(t: torch.Tensor) -> list:
    return t.detach().double().tolist()


def logits(seed: int, n: int, v: int = V, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).float()


def assert_grad(got: torch.Tensor, want: list[list[float]], tol: float = 1e-5) -> None:
    assert got is not None
    diff = max(abs(g - w) for gr, wr in zip(rows(got), want, strict=True) for g, w in zip(gr, wr, strict=True))
    assert diff <= tol, f"max |grad - reference| = {diff}"


def dlogp(p: list[float], y: int, u: int) -> float:
    """d log softmax(z)_y / d z_u = [u == y] - p_u."""
    return (1.0 if u == y else 0.0) - p[u]


def ref_ppo(z_rows, targets, behaviour, adv, n, *, cl=CL, ch=CH, c=C, ref=None, kl=0.0):
    """Clipped surrogate with dual clip, + kl * k3; value, metrics, per-token regime and gradient."""
    pg_sum = ratio_sum = clipped = dual = k3_sum = 0.0
    regimes, grad = [], []
    for i, (z, y, b, a) in enumerate(zip(z_rows, targets, behaviour, adv, strict=True)):
        logp = log_softmax_row(z)
        p = [math.exp(x) for x in logp]
        r = math.exp(logp[y] - b)
        rc = min(max(r, 1.0 - cl), 1.0 + ch)
        unclipped, clamped = -a * r, -a * rc
        if clamped > unclipped:  # the clamped branch is the max (and so differs from r): constant, no gradient
            pg, w, regime = clamped, 0.0, "clipped"
            clipped += 1
        else:
            pg, w, regime = unclipped, -a * r, "unclipped"  # d(-A r)/d logp = -A r
        if a < 0 and c is not None and -a * c < pg:
            pg, w, regime = -a * c, 0.0, "dual"
            dual += 1
        pg_sum += pg
        ratio_sum += r
        regimes.append(regime)
        g_logp = w
        if ref is not None:
            d = ref[i] - logp[y]
            k3_sum += math.exp(d) - d - 1
            g_logp += kl * (1 - math.exp(d))  # d k3 / d logp = -(e^D - 1)
        grad.append([g_logp * dlogp(p, y, u) / n for u in range(len(z))])
    out = {"pg": pg_sum / n, "ratio": ratio_sum / n, "clip_frac": clipped / n, "dual_clip_frac": dual / n,
           "advantage": sum(adv) / n, "regimes": regimes, "grad": grad}
    out["loss"] = (pg_sum + (kl * k3_sum if ref is not None and kl > 0 else 0.0)) / n
    if ref is not None:
        out["k3"] = k3_sum / n
    return out


# Seven tokens, one per regime of the defaults (clip_low 0.2, clip_high 0.28, dual clip 10):
#        ratio  advantage  regime        per-token pg (hand)
CASES = [(1.1, 0.8),    # inside, A > 0       -A r = -0.88
         (0.9, -0.6),   # inside, A < 0       -A r = 0.54
         (1.5, 1.0),    # above 1 + ch, A > 0 clipped: -A (1 + ch) = -1.28 (> -1.5), no gradient
         (0.5, -0.5),   # below 1 - cl, A < 0 clipped: -A (1 - cl) = 0.4 (> 0.25), no gradient
         (2.0, -0.5),   # above 1 + ch, A < 0 unclipped: -A r = 1.0 (> 0.64), under dual -A c = 5
         (15.0, -0.3),  # far above, A < 0    dual clip: min(-A r = 4.5, -A c = 3.0) = 3.0, no gradient
         (0.5, 0.7)]    # below 1 - cl, A > 0 unclipped: -A r = -0.35 (> -0.56)
HAND_PG = [-0.88, 0.54, -1.28, 0.4, 1.0, 3.0, -0.35]
HAND_REGIMES = ["unclipped", "unclipped", "clipped", "clipped", "unclipped", "dual", "unclipped"]
TARGETS = [3, 1, 5, 0, 2, 4, 1]


def ppo_case(ratios: list[float], seed: int = 1, targets: list[int] = TARGETS):
    """Logits, targets and behaviour log-probs chosen so that exp(log p(y) - behaviour) = ratio."""
    z = leaf(logits(seed, len(ratios)))
    y = targets[:len(ratios)]
    logp_y = [log_softmax_row(r)[t] for r, t in zip(rows(z), y, strict=True)]
    behaviour = torch.tensor([lp - math.log(x) for lp, x in zip(logp_y, ratios, strict=True)])
    return z, torch.tensor(y), behaviour


def ref_logp(seed: int, n: int, targets: list[int] = TARGETS) -> torch.Tensor:
    zr = logits(seed, n)
    return torch.tensor([log_softmax_row(r)[t] for r, t in zip(rows(zr), targets[:n], strict=True)])


def check(out, want, tol: float = 1e-5):
    assert close(out.loss, want["loss"]), (float(out.loss), want["loss"])
    for key in ("pg", "ratio", "clip_frac", "dual_clip_frac", "advantage") + (("k3",) if "k3" in want else ()):
        assert key in out.metrics, key
        assert close(out.metrics[key], want[key], tol), (key, float(out.metrics[key]), want[key])
    if "k3" not in want:
        assert "k3" not in out.metrics
    assert all(not v.requires_grad for v in out.metrics.values())


# --------------------------------------------------------------------------- group_advantages


@pytest.mark.parametrize(("rewards", "want"), [
    ([1.0, 0.0, 0.0, 1.0], [0.8660254, -0.8660254, -0.8660254, 0.8660254]),  # +-0.5 / sqrt(1/3)
    ([1.0, 0.0, 0.0, 0.0], [1.5, -0.5, -0.5, -0.5]),  # mean 1/4, unbiased var (9/16 + 3/16) / 3 = 1/4
    ([0.0, 1.0], [-1 / math.sqrt(2), 1 / math.sqrt(2)]),  # std (unbiased) sqrt(1/2)
])
def test_group_advantages_hand_numbers(rewards, want):
    for dtype in (torch.float32, torch.float64):
        got = L.group_advantages(torch.tensor(rewards, dtype=dtype))
        assert got.dtype == torch.float32 and got.shape == (len(rewards),)
        assert all(close(g, w, 1e-5) for g, w in zip(got.tolist(), want, strict=True)), got


def test_group_advantages_against_loop_with_penalties_and_eps():
    rewards = [0.5, -1.0, 1.0, 0.0, -0.25]  # e.g. accuracy + overlong penalty
    for eps in (1e-6, 0.5):
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        want = [(r - mean) / (std + eps) for r in rewards]
        got = L.group_advantages(torch.tensor(rewards), eps=eps)
        assert all(close(g, w, 1e-5) for g, w in zip(got.tolist(), want, strict=True)), (eps, got, want)
    assert close(L.group_advantages(torch.tensor(rewards)).sum(), 0.0, 1e-5)  # centred


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [-0.5, -0.5], [0.7], [1.0]])
def test_group_advantages_degenerate_groups_are_zero(rewards):
    got = L.group_advantages(torch.tensor(rewards))
    assert got.dtype == torch.float32 and got.shape == (len(rewards),)
    assert torch.isfinite(got).all() and (got == 0).all(), got


# --------------------------------------------------------------------------- dynamic sampling


@pytest.mark.parametrize(("correct", "keep"), [
    ([0, 1, 1, 0], True), ([1, 0], True), ([0, 0, 0, 1], True),
    ([1, 1, 1, 1], False), ([0, 0, 0], False), ([1], False), ([0], False),
])
def test_dynamic_sampling_keep(correct, keep):
    for t in (torch.tensor(correct), torch.tensor(correct, dtype=torch.float32), torch.tensor(correct).bool()):
        got = L.dynamic_sampling_keep(t)
        assert isinstance(got, bool) and got is keep, (t, got)


# --------------------------------------------------------------------------- ppo_clip


def test_reference_regimes_match_the_hand_table():
    """The reference itself: hand-computed per-token pg and regimes for the seven-token table."""
    z, y, behaviour = ppo_case([r for r, _ in CASES])
    adv = [a for _, a in CASES]
    want = ref_ppo(rows(z), y.tolist(), rows(behaviour), adv, 7)
    assert want["regimes"] == HAND_REGIMES
    assert close(want["pg"], sum(HAND_PG) / 7, 1e-6)  # behaviour is float32
    assert want["clip_frac"] == 2 / 7 and want["dual_clip_frac"] == 1 / 7


@pytest.mark.parametrize("n", [7, 11])  # num_tokens > N: a chunk of a larger step
def test_ppo_clip_every_regime_value_metrics_and_gradient(n):
    z, y, behaviour = ppo_case([r for r, _ in CASES])
    adv = [a for _, a in CASES]
    out = L.ppo_clip(z, y, behaviour, torch.tensor(adv), n)
    want = ref_ppo(rows(z), y.tolist(), rows(behaviour), adv, n)
    check(out, want)
    assert close(out.loss, sum(HAND_PG) / n) and close(out.metrics["pg"], sum(HAND_PG) / n)
    assert close(out.metrics["clip_frac"], 2 / n) and close(out.metrics["dual_clip_frac"], 1 / n)
    assert close(out.metrics["ratio"], sum(r for r, _ in CASES) / n)
    out.loss.backward()
    assert_grad(z.grad, want["grad"])
    # zero gradient exactly on the clipped and dual-clipped tokens, nonzero elsewhere
    for row, regime in zip(z.grad.tolist(), HAND_REGIMES, strict=True):
        assert (max(abs(g) for g in row) == 0.0) == (regime != "unclipped"), (regime, row)


def test_ppo_clip_defaults_are_the_spec_values():
    z, y, behaviour = ppo_case([r for r, _ in CASES])
    adv = torch.tensor([a for _, a in CASES])
    a = L.ppo_clip(z, y, behaviour, adv, 7)
    b = L.ppo_clip(z, y, behaviour, adv, 7, clip_low=0.2, clip_high=0.28, dual_clip=10.0, ref_logp_N=None,
                   kl_coef=0.0)
    assert close(a.loss, b.loss, 1e-7) and a.metrics.keys() == b.metrics.keys()


@pytest.mark.parametrize(("cl", "ch", "c"), [(0.2, 0.28, None), (0.2, 0.2, 10.0), (0.1, 0.5, 3.0), (0.3, 0.1, 1.5)])
def test_ppo_clip_other_clip_settings(cl, ch, c):
    """No dual clip (token 6 then takes -A r = 4.5 with gradient), symmetric PPO, and dual clips
    small enough to catch token 5 (c = 1.5 < r = 2) too."""
    z, y, behaviour = ppo_case([r for r, _ in CASES])
    adv = [a for _, a in CASES]
    out = L.ppo_clip(z, y, behaviour, torch.tensor(adv), 7, clip_low=cl, clip_high=ch, dual_clip=c)
    want = ref_ppo(rows(z), y.tolist(), rows(behaviour), adv, 7, cl=cl, ch=ch, c=c)
    check(out, want)
    if c is None:
        assert want["regimes"][5] == "unclipped" and close(out.metrics["dual_clip_frac"], 0.0)
    if c == 1.5:
        assert want["regimes"][4] == "dual"
    out.loss.backward()
    assert_grad(z.grad, want["grad"])


def test_ppo_clip_on_policy_ratio_one_gradient_is_minus_advantage_grad_logp():
    z = leaf(logits(3, 5))
    y = torch.tensor([0, 5, 2, 2, 4])
    behaviour = torch.log_softmax(z.detach(), -1).gather(-1, y[:, None]).squeeze(-1)  # = current log-probs
    adv, n = [0.7, -1.2, 0.3, 0.0, -0.4], 8
    out = L.ppo_clip(z, y, behaviour, torch.tensor(adv), n)
    assert close(out.loss, -sum(adv) / n) and close(out.metrics["pg"], -sum(adv) / n)
    assert close(out.metrics["ratio"], 5 / n)
    assert float(out.metrics["clip_frac"]) == 0.0 and float(out.metrics["dual_clip_frac"]) == 0.0
    assert close(out.metrics["advantage"], sum(adv) / n)
    out.loss.backward()
    p = [softmax_row(r) for r in rows(z)]
    assert_grad(z.grad, [[-a * dlogp(pt, t, u) / n for u in range(V)]
                         for a, pt, t in zip(adv, p, y.tolist(), strict=True)])


@pytest.mark.parametrize("kl", [0.0, 0.1, 1.0])
def test_ppo_clip_k3_value_metric_and_gradient(kl):
    z, y, behaviour = ppo_case([r for r, _ in CASES])
    adv = [a for _, a in CASES]
    ref = ref_logp(5, 7)
    n = 9
    out = L.ppo_clip(z, y, behaviour, torch.tensor(adv), n, ref_logp_N=ref, kl_coef=kl)
    want = ref_ppo(rows(z), y.tolist(), rows(behaviour), adv, n, ref=rows(ref), kl=kl)
    check(out, want)  # k3 metric reported whenever ref is given, even with kl_coef = 0
    assert want["k3"] > 0
    assert close(out.loss, want["pg"] + kl * want["k3"])
    out.loss.backward()
    assert_grad(z.grad, want["grad"])


def test_ppo_clip_k3_hand_value():
    """One on-policy token with A = 0: the loss is kl * k3 alone; D = ref - logp = log 2 -> k3 = 2 - log 2 - 1."""
    z = leaf(logits(4, 1))
    y = torch.tensor([2])
    logp = log_softmax_row(rows(z)[0])[2]
    out = L.ppo_clip(z, y, torch.tensor([logp]), torch.tensor([0.0]), 1, ref_logp_N=torch.tensor([logp + math.log(2)]),
                     kl_coef=0.5)
    assert close(out.metrics["k3"], 1 - math.log(2)) and close(out.loss, 0.5 * (1 - math.log(2)))
    out.loss.backward()
    p = softmax_row(rows(z)[0])
    assert_grad(z.grad, [[0.5 * (1 - 2) * dlogp(p, 2, u) for u in range(V)]])  # kl (1 - e^D) grad logp


def test_ppo_clip_kl_off_without_ref_and_ref_without_kl():
    z, y, behaviour = ppo_case([r for r, _ in CASES])
    adv = torch.tensor([a for _, a in CASES])
    plain = L.ppo_clip(z, y, behaviour, adv, 7)
    with_ref = L.ppo_clip(z, y, behaviour, adv, 7, ref_logp_N=ref_logp(5, 7), kl_coef=0.0)
    assert "k3" not in plain.metrics and "k3" in with_ref.metrics
    assert close(plain.loss, with_ref.loss, 1e-7)


def test_ppo_clip_advantage_is_detached():
    z, y, behaviour = ppo_case([1.1, 0.9, 2.0])
    adv = torch.tensor([0.3, -0.2, -0.1], requires_grad=True)
    L.ppo_clip(z, y, behaviour, adv, 3).loss.backward()
    assert adv.grad is None or float(adv.grad.abs().sum()) == 0.0
    assert z.grad is not None and float(z.grad.abs().sum()) > 0


# --------------------------------------------------------------------------- invariants


def _chunk_inputs():
    n = 7
    ratios = [r for r, _ in CASES]
    z, y, behaviour = ppo_case(ratios, seed=2)
    adv = torch.tensor([a for _, a in CASES])
    ref = ref_logp(6, n)
    return z.detach(), {
        "plain": lambda x, s: L.ppo_clip(x, y[s], behaviour[s], adv[s], n),
        "no-dual": lambda x, s: L.ppo_clip(x, y[s], behaviour[s], adv[s], n, dual_clip=None),
        "kl": lambda x, s: L.ppo_clip(x, y[s], behaviour[s], adv[s], n, ref_logp_N=ref[s], kl_coef=0.3),
        "response-mean": lambda x, s: L.ppo_clip(x, y[s], behaviour[s], adv[s], n, ref_logp_N=ref[s], kl_coef=0.3,
                                                 token_weight_N=token_weights(LENGTHS)[s]),
    }


@pytest.mark.parametrize("name", list(_chunk_inputs()[1]))
def test_ppo_clip_chunks_add_up_to_the_whole(name):
    z, fns = _chunk_inputs()
    assert_chunks_add_up(fns[name], z, ((0, 2), (2, 3), (3, 7)))


@pytest.mark.parametrize("name", list(_chunk_inputs()[1]))
def test_ppo_clip_bf16_logits(name):
    z, fns = _chunk_inputs()
    assert_bf16_accepted(fns[name], z)


# --------------------------------------------------------------------------- per-response mean (--aggregation)

LENGTHS = [2, 1, 4]  # the seven CASES tokens as three responses


def test_response_mean_weights_hand_numbers():
    assert L.response_mean_weights([2, 1, 4]) == pytest.approx([7 / 6, 7 / 3, 7 / 12])  # 7 / (3 T_i)
    assert L.response_mean_weights([5, 5]) == [1.0, 1.0]  # equal lengths: the token mean
    assert L.response_mean_weights([3]) == [1.0]


def token_weights(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([w for w, t in zip(L.response_mean_weights(lengths), lengths, strict=True) for _ in range(t)])


@pytest.mark.parametrize("kl", [0.0, 0.3])
def test_ppo_clip_response_mean_is_the_mean_of_per_response_means(kl):
    """The GRPO paper's aggregation, (1/B) sum_i (1/T_i) sum_t (pg_t + kl k3_t), from ref_ppo run on each response
    alone (its own token mean), against ppo_clip with the per-token weights: value, pg, k3 and gradient."""
    ratios = [r for r, _ in CASES]
    adv = [a for _, a in CASES]
    z, y, behaviour = ppo_case(ratios, seed=3)
    ref = ref_logp(7, len(CASES))
    out = L.ppo_clip(z, y, behaviour, torch.tensor(adv), len(CASES), ref_logp_N=ref, kl_coef=kl,
                     token_weight_N=token_weights(LENGTHS))
    loss = pg = k3 = 0.0
    grad = []
    start = 0
    for t in LENGTHS:
        s = slice(start, start + t)
        want = ref_ppo(rows(z)[s], y.tolist()[s], behaviour.tolist()[s], adv[s], t, ref=ref.tolist()[s], kl=kl)
        loss, pg, k3 = loss + want["loss"] / 3, pg + want["pg"] / 3, k3 + want["k3"] / 3
        grad += [[g / 3 for g in row] for row in want["grad"]]
        start += t
    assert close(out.loss, loss) and close(out.metrics["pg"], pg) and close(out.metrics["k3"], k3)
    token_mean = L.ppo_clip(z.detach(), y, behaviour, torch.tensor(adv), len(CASES), ref_logp_N=ref, kl_coef=kl)
    assert not close(token_mean.loss, loss, 1e-2)  # the two aggregations differ on these lengths
    assert close(out.metrics["ratio"], token_mean.metrics["ratio"])  # the other metrics stay token means
    out.loss.backward()
    assert_grad(z.grad, grad)
