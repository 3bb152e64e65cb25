"""opd_train.losses against references written here from docs/architecture.md ("Objectives"), independently of
the torch code: plain Python loops over small tensors (V = 7, N = 3) in float64, from the
equations, values and gradients. Plus the invariants: chunk (micro-batch) invariance, zero for
identical distributions, bf16 logits, gradchecks of the analytic shift gradient."""

from __future__ import annotations

import math

import pytest
import torch

from opd_train import losses as L

V, N = 7, 3


# --------------------------------------------------------------------------- references (plain python)


def log_softmax_row(z: list[float]) -> list[float]:
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def softmax_row(z: list[float]) -> list[float]:
    return [math.exp(x) for x in log_softmax_row(z)]


def rows(t: torch.Tensor) -> list:
    return t.detach().double().tolist()


def logits(seed: int, n: int = N, v: int = V, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).float()


def leaf(z: torch.Tensor) -> torch.Tensor:
    return z.detach().clone().requires_grad_(True)


def close(a, b, tol: float = 1e-5) -> bool:
    a, b = (x.detach() if isinstance(x, torch.Tensor) else x for x in (a, b))
    return abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b)))


def assert_grad(got: torch.Tensor, want: list[list[float]], tol: float = 2e-6) -> None:
    assert got is not None
    diff = max(abs(g - w) for gr, wr in zip(rows(got), want, strict=True) for g, w in zip(gr, wr, strict=True))
    assert diff <= tol, f"max |grad - reference| = {diff}"


def dlogp(p: list[float], y: int, u: int) -> float:
    """d log softmax(z)_y / d z_u = [u == y] - p_u."""
    return (1.0 if u == y else 0.0) - p[u]


def ref_fkl(z_rows, ids_rows, tlogp_rows, n, *, tau, clip, tail):
    """OPSD forward KL over k teacher ids (+ tail bucket), per summand clip; value, metrics, gradient.

    tail: both sides' (k+1) buckets at temperature 1 (p(k) at the ids, the rest's mass in the tail), each
    tempered as a categorical, q(b) = P(b)^(1/tau) / sum_b' P(b')^(1/tau)."""
    loss = unclipped = clipped_tokens = tail_mass = 0.0
    grad, summands = [], []
    for z, ids, tl in zip(z_rows, ids_rows, tlogp_rows, strict=True):
        p = softmax_row(z)
        pt = [math.exp(x) for x in tl]
        m = max(0.0, 1.0 - sum(pt))
        tail_mass += m
        rest = [v for v in range(len(z)) if v not in ids]
        if tail:
            w = [x ** (1 / tau) for x in pt] + [m ** (1 / tau)]
            ps_b = [p[v] for v in ids] + [sum(p[v] for v in rest)]
            ws = [x ** (1 / tau) for x in ps_b]
            qs_b = [x / sum(ws) for x in ws]
        else:
            qs = softmax_row([x / tau for x in z])
            w = [x ** (1 / tau) for x in pt]
            s = sum(qs[v] for v in ids)
            qs_b = [qs[v] / s for v in ids]
        qt_b = [x / sum(w) for x in w]
        j = [qt * (math.log(qt) - math.log(qsb)) if qt > 0 else 0.0 for qt, qsb in zip(qt_b, qs_b, strict=True)]
        summands.append(j)
        keep = [clip is None or jb <= clip for jb in j]
        loss += sum(jb if k else clip for jb, k in zip(j, keep, strict=True))
        unclipped += sum(j)
        clipped_tokens += not all(keep)

        def dlog_ps(b: int, u: int) -> float:  # d log P_S(bucket b) / d z_u, at temperature 1
            if b < len(ids):
                return dlogp(p, ids[b], u)
            return (p[u] / ps_b[-1] if u in rest else 0.0) - p[u]

        def dlog_qs(b: int, u: int) -> float:  # d log q_S(bucket b) / d z_u
            if not tail:
                return ((1.0 if u == ids[b] else 0.0) - qs[u] / s) / tau if u in ids else 0.0
            return (dlog_ps(b, u) - sum(q * dlog_ps(c, u) for c, q in enumerate(qs_b))) / tau

        grad.append([sum(-qt_b[b] * dlog_qs(b, u) for b in range(len(qt_b)) if keep[b]) / n for u in range(len(z))])
    return {"loss": loss / n, "fkl": unclipped / n, "fkl_clipped_frac": clipped_tokens / n,
            "teacher_tail_mass": tail_mass / n, "grad": grad, "summands": summands}


def ref_fkl_full(z_rows, t_rows, n, *, tau, clip):
    loss = unclipped = clipped_tokens = 0.0
    grad, summands = [], []
    for z, zt in zip(z_rows, t_rows, strict=True):
        qs = softmax_row([x / tau for x in z])
        qt = softmax_row([x / tau for x in zt])
        j = [qt[v] * (math.log(qt[v]) - math.log(qs[v])) for v in range(len(z))]
        summands.append(j)
        keep = [clip is None or jv <= clip for jv in j]
        loss += sum(jv if k else clip for jv, k in zip(j, keep, strict=True))
        unclipped += sum(j)
        clipped_tokens += not all(keep)
        grad.append([sum(-qt[v] * dlogp(qs, v, u) / tau for v in range(len(z)) if keep[v]) / n
                     for u in range(len(z))])
    return {"loss": loss / n, "fkl": unclipped / n, "fkl_clipped_frac": clipped_tokens / n, "grad": grad,
            "summands": summands}


def ref_shift(z_rows, ids_rows, delta_rows, targets, ref_logp, n, *, beta):
    """Direct-OPD: weights p_S(k) / sum_K p_S, A = w delta, policy -sum A log p_S(k), + beta k3."""
    policy = k3 = shift_sum = 0.0
    grad = []
    for z, ids, delta, y, lr in zip(z_rows, ids_rows, delta_rows, targets, ref_logp, strict=True):
        logp = log_softmax_row(z)
        p = [math.exp(x) for x in logp]
        mass = sum(p[v] for v in ids)
        a = [p[v] / mass * d for v, d in zip(ids, delta, strict=True)]
        policy -= sum(ak * logp[v] for ak, v in zip(a, ids, strict=True))
        shift_sum += sum(a)
        d = lr - logp[y]
        k3 += math.exp(d) - d - 1
        # the closed form of the docstring: (p_v sum_k A_k - A_v [v in K]) + beta (1 - e^D) d log p(y)/dz_v
        grad.append([(p[u] * sum(a) - sum(ak for ak, v in zip(a, ids, strict=True) if v == u)
                      + beta * (1 - math.exp(d)) * dlogp(p, y, u)) / n for u in range(len(z))])
    return {"loss": (policy + beta * k3) / n, "policy": policy / n, "k3": k3 / n, "weighted_shift": shift_sum / n,
            "grad": grad}


def teacher_topk(seed: int, k: int, n: int = N, v: int = V, scale: float = 2.0):
    """A full teacher distribution; its top-k ids by probability and their float32 log-probs."""
    zt = logits(seed, n, v, scale)
    ids = torch.tensor([sorted(range(v), key=lambda i, r=r: -r[i])[:k] for r in rows(zt)])
    tlogp = torch.tensor([[log_softmax_row(r)[i] for i in idr] for r, idr in zip(rows(zt), ids.tolist(), strict=True)])
    return zt, ids, tlogp


# --------------------------------------------------------------------------- sft


def test_sft_value_metric_and_gradient():
    z, y, n = leaf(logits(0)), torch.tensor([2, 0, 6]), 5  # num_tokens > N: a chunk of a larger step
    out = L.sft(z, y, n)
    want = -sum(log_softmax_row(r)[t] for r, t in zip(rows(z), y.tolist(), strict=True)) / n
    assert close(out.loss, want) and close(out.metrics["nll"], want)
    out.loss.backward()
    assert_grad(z.grad, [[-dlogp(softmax_row(r), t, u) / n for u in range(V)]
                         for r, t in zip(rows(z), y.tolist(), strict=True)])


# --------------------------------------------------------------------------- rkl


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_rkl_advantages_definition(discount):
    teacher = [-0.5, -2.0, -0.1, -3.0, -0.25]
    behaviour = [-1.0, -0.3, -0.2, -0.7, -0.25]
    r = [t - b for t, b in zip(teacher, behaviour, strict=True)]
    want = [sum(discount ** (s - t) * r[s] for s in range(t, len(r))) for t in range(len(r))]
    got = L.rkl_advantages(torch.tensor(teacher), torch.tensor(behaviour), discount)
    assert got.dtype == torch.float32 and got.shape == (5,)
    assert all(close(g, w, 1e-6) for g, w in zip(got.tolist(), want, strict=True))


def _rkl_case(rho: list[float]):
    """Logits, targets and behaviour log-probs chosen so that exp(log p_S - behaviour) = rho."""
    z, y = leaf(logits(1)), [3, 1, 5]
    logp_y = [log_softmax_row(r)[t] for r, t in zip(rows(z), y, strict=True)]
    behaviour = torch.tensor([lp - math.log(x) for lp, x in zip(logp_y, rho, strict=True)])
    return z, torch.tensor(y), behaviour, [softmax_row(r) for r in rows(z)]


def test_rkl_on_policy_ratio_one_gradient_is_minus_advantage_grad_logp():
    z, y, behaviour, p = _rkl_case([1.0, 1.0, 1.0])
    adv, teacher, n = [0.7, -1.2, 0.3], torch.tensor([-0.4, -2.5, -1.0]), 4
    out = L.rkl(z, y, behaviour, torch.tensor(adv), n, teacher_logp_N=teacher)
    assert close(out.loss, -sum(adv) / n)
    assert close(out.metrics["ratio"], 3 / n) and out.metrics["ratio_clipped"] == 0
    assert close(out.metrics["advantage"], sum(adv) / n)
    assert close(out.metrics["reverse_kl"], sum(b - t for b, t in zip(rows(behaviour), rows(teacher), strict=True)) / n)
    out.loss.backward()
    assert_grad(z.grad, [[-a * dlogp(pt, t, u) / n for u in range(V)]
                         for a, pt, t in zip(adv, p, y.tolist(), strict=True)])


@pytest.mark.parametrize("ratio_clip", [None, 1.2])
def test_rkl_truncated_ratio_value_gradient_and_metrics(ratio_clip):
    rho = [0.5, 1.5, 3.0]
    z, y, behaviour, p = _rkl_case(rho)
    adv, n = [0.7, -1.2, 0.3], 3
    capped = [min(x, ratio_clip) if ratio_clip else x for x in rho]  # value min(rho, c)
    out = L.rkl(z, y, behaviour, torch.tensor(adv), n, ratio_clip=ratio_clip)
    assert close(out.loss, -sum(a * c for a, c in zip(adv, capped, strict=True)) / n)
    assert close(out.metrics["ratio"], sum(capped) / n)
    assert close(out.metrics["ratio_clipped"], (2 if ratio_clip else 0) / n)
    assert close(out.metrics["reverse_kl"], -sum(adv) / n)  # no teacher log-probs given: -A (discount 0)
    out.loss.backward()  # gradient min(rho, c) grad log p: truncation keeps the gradient, caps its weight
    assert_grad(z.grad, [[-a * c * dlogp(pt, t, u) / n for u in range(V)]
                         for a, c, pt, t in zip(adv, capped, p, y.tolist(), strict=True)])


def test_rkl_advantage_is_detached():
    z, y, behaviour, _ = _rkl_case([1.0, 2.0, 0.5])
    adv = torch.tensor([0.3, 0.2, -0.1], requires_grad=True)
    L.rkl(z, y, behaviour, adv, 3).loss.backward()
    assert adv.grad is None


# --------------------------------------------------------------------------- fkl (top-k)


TAUS = [0.7, 1.0, 1.1, 1.5]


@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("tail", [True, False])
def test_fkl_against_reference_without_clip(tau, tail):
    _, ids, tlogp = teacher_topk(seed=2, k=3)
    z, n = leaf(logits(3)), 4
    want = ref_fkl(rows(z), ids.tolist(), rows(tlogp), n, tau=tau, clip=None, tail=tail)
    out = L.fkl(z, ids, tlogp, n, temperature=tau, clip=None, tail=tail)
    assert close(out.loss, want["loss"]) and close(out.metrics["fkl"], want["fkl"])
    assert out.metrics["fkl_clipped_frac"] == 0
    assert close(out.metrics["teacher_tail_mass"], want["teacher_tail_mass"])  # at temperature 1, also at tau
    assert want["teacher_tail_mass"] > 0.05  # the tail bucket matters here
    out.loss.backward()
    assert_grad(z.grad, want["grad"])


@pytest.mark.parametrize("tail", [True, False])
def test_fkl_clip_caps_summands_and_zeroes_their_gradient(tail):
    _, ids, tlogp = teacher_topk(seed=4, k=3)
    z, n, clip = leaf(logits(5)), 3, 0.05
    want = ref_fkl(rows(z), ids.tolist(), rows(tlogp), n, tau=1.1, clip=clip, tail=tail)
    flat = [j for row in want["summands"] for j in row]
    assert any(j > clip for j in flat) and any(j < clip for j in flat)  # the clip is active on some only
    assert min(abs(j - clip) for j in flat) > 1e-3  # away from the kink
    out = L.fkl(z, ids, tlogp, n, temperature=1.1, clip=clip, tail=tail)
    assert close(out.loss, want["loss"]) and close(out.metrics["fkl"], want["fkl"])
    assert close(out.metrics["fkl_clipped_frac"], want["fkl_clipped_frac"])
    out.loss.backward()
    assert_grad(z.grad, want["grad"])  # the reference sums the gradient of unclipped summands only
    unclipped = ref_fkl(rows(z), ids.tolist(), rows(tlogp), n, tau=1.1, clip=None, tail=tail)["grad"]
    assert max(abs(a - b) for ra, rb in zip(rows(z.grad), unclipped, strict=True)
               for a, b in zip(ra, rb, strict=True)) > 1e-3


def test_fkl_tail_false_is_renormalized_over_k():
    """OPSD's variant: both sides renormalized over the k ids, so the tail never matters."""
    _, ids, tlogp = teacher_topk(seed=6, k=3)
    z = logits(7)
    moved = z.clone()
    for t, idr in enumerate(ids.tolist()):
        for v in range(V):
            if v not in idr:
                moved[t, v] += 5.0  # mass outside the k ids changes, not the ratios inside
    base = L.fkl(z, ids, tlogp, N, clip=None, tail=False).loss
    assert close(L.fkl(moved, ids, tlogp, N, clip=None, tail=False).loss, base, 1e-6)
    assert not close(L.fkl(moved, ids, tlogp, N, clip=None, tail=True).loss,
                     L.fkl(z, ids, tlogp, N, clip=None, tail=True).loss, 1e-2)
    scaled = tlogp - 0.3  # a teacher top-k that no longer sums to the same mass: same after renormalizing
    assert close(L.fkl(z, ids, scaled, N, clip=None, tail=False).loss, base, 1e-6)


def _full_vocab_rows(seed: int, count: int, remainder: bool):
    """Teacher/student logits and float32 teacher log-probs over the whole vocabulary, for rows whose
    rounding remainder 1 - sum_v p_T(v) (float32, as fkl computes the tail mass) is > 0 or <= 0."""
    zt_all, z_all = logits(seed, 64), logits(seed + 1, 64)
    tl_all = torch.log_softmax(zt_all, -1)
    keep = [t for t in range(64) if (float(1.0 - tl_all[t].exp().sum()) > 0) == remainder][:count]
    assert len(keep) == count
    return zt_all[keep], z_all[keep], tl_all[keep]


@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("clip", [None, 0.05])
def test_fkl_tail_with_k_equal_v_is_fkl_full(tau, clip):
    zt, z, tlogp = _full_vocab_rows(seed=8, count=3, remainder=False)
    ids = torch.arange(V).expand(3, V)
    a, b = leaf(z), leaf(z)
    top = L.fkl(a, ids, tlogp, 3, temperature=tau, clip=clip, tail=True)
    full = L.fkl_full(b, zt, 3, temperature=tau, clip=clip)
    assert close(top.loss, full.loss, 1e-5) and close(top.metrics["fkl"], full.metrics["fkl"], 1e-5)
    (top.loss + full.loss).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_fkl_tail_with_k_equal_v_is_fkl_full_for_any_teacher():
    zt, z, tlogp = _full_vocab_rows(seed=8, count=3, remainder=True)
    ids = torch.arange(V).expand(N, V)
    top = L.fkl(z, ids, tlogp, N, clip=None, tail=True)
    full = L.fkl_full(z, zt, N, clip=None)
    assert close(top.loss, full.loss, 1e-5)


# --------------------------------------------------------------------------- fkl_full


@pytest.mark.parametrize("tau", [1.0, 1.1])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_fkl_full_against_reference(tau, clip):
    zt, z, n = leaf(logits(11)), leaf(logits(12)), 5
    want = ref_fkl_full(rows(z), rows(zt), n, tau=tau, clip=clip)
    if clip is not None:
        flat = [j for row in want["summands"] for j in row]
        assert any(j > clip for j in flat) and any(j < clip for j in flat)
        assert min(abs(j - clip) for j in flat) > 1e-3
    out = L.fkl_full(z, zt, n, temperature=tau, clip=clip)
    assert close(out.loss, want["loss"]) and close(out.metrics["fkl"], want["fkl"])
    assert close(out.metrics["fkl_clipped_frac"], want["fkl_clipped_frac"])
    out.loss.backward()
    assert_grad(z.grad, want["grad"])
    assert zt.grad is None  # the teacher is a constant


@pytest.mark.parametrize("tau", TAUS)
def test_fkl_tail_with_k_equal_v_minus_1_is_fkl_full(tau):
    """One id outside the k: its tail bucket is that one token, tempered exactly."""
    zt, z = logits(15), leaf(logits(16))
    ids = torch.topk(zt, V - 1, -1).indices
    tlogp = zt.gather(-1, ids) - torch.logsumexp(zt, -1, keepdim=True)
    b = leaf(z)
    top = L.fkl(z, ids, tlogp, N, temperature=tau, clip=None, tail=True)
    full = L.fkl_full(b, zt, N, temperature=tau, clip=None)
    assert close(top.loss, full.loss, 1e-5)
    (top.loss + full.loss).backward()
    assert torch.allclose(z.grad, b.grad, atol=1e-6)


@pytest.mark.parametrize("tau", TAUS)
def test_fkl_tail_approaches_fkl_full_as_k_grows(tau):
    """Over V = 256 ids (teacher top-k by probability): |top-k KL - full KL| shrinks with k and is ~0 at k = V."""
    g = torch.Generator().manual_seed(17)
    zt = torch.randn(16, 256, generator=g) * 2.5
    z = zt + torch.randn(16, 256, generator=g) * 0.5
    order = torch.argsort(zt, -1, descending=True)
    tlogp = zt.gather(-1, order) - torch.logsumexp(zt, -1, keepdim=True)
    full = float(L.fkl_full(z, zt, 16, temperature=tau, clip=None).loss)
    errors = [abs(float(L.fkl(z, order[:, :k], tlogp[:, :k], 16, temperature=tau, clip=None).loss) - full)
              for k in (1, 4, 16, 64, 128, 256)]
    assert errors[0] > 0.02 and all(a > b for a, b in zip(errors, errors[1:], strict=False))
    assert errors[-1] < 1e-6


def identity_topk(z: torch.Tensor, k: int = 3):
    """The student's own top-k and their log-probs as opd-score's hf teacher computes them (logit - logsumexp)."""
    ids = torch.topk(z.detach(), k, -1).indices
    return ids, z.detach().gather(-1, ids) - torch.logsumexp(z.detach(), -1, keepdim=True)


@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("clip", [None, 0.05])
def test_zero_for_identical_distributions(tau, clip):
    z = leaf(logits(13))
    full = L.fkl_full(z, z.detach().clone(), N, temperature=tau, clip=clip)
    assert abs(float(full.loss.detach())) < 1e-6 and abs(float(full.metrics["fkl"])) < 1e-6
    full.loss.backward()
    assert float(z.grad.abs().max()) < 1e-6
    ids, tlogp = identity_topk(z)
    renorm = L.fkl(z, ids, tlogp, N, temperature=tau, clip=clip, tail=False)
    assert abs(float(renorm.loss.detach())) < 1e-6


@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("v, k", [(V, 3), (V, V), (4096, 16)])
def test_fkl_tail_is_zero_at_identity(tau, clip, v, k):
    """Teacher = student: the same bucket construction on both sides gives exactly 0 loss and a gradient of float32
    rounding only (the tail tempered as one bucket on the teacher side but not the student's gave ~1e-3 here)."""
    z = leaf(logits(18, v=v, scale=3.0))
    ids, tlogp = identity_topk(z, k)
    out = L.fkl(z, ids, tlogp, N, temperature=tau, clip=clip, tail=True)
    assert float(out.loss.detach()) == 0.0 and float(out.metrics["fkl"]) == 0.0
    assert float(out.metrics["fkl_clipped_frac"]) == 0.0
    out.loss.backward()
    assert float(z.grad.abs().max()) < 1e-7


# --------------------------------------------------------------------------- shift


def _shift_case(seed: int = 14, k: int = 3):
    z = leaf(logits(seed))
    ids = torch.topk(z.detach(), k, -1).indices  # the student's top-k
    g = torch.Generator().manual_seed(seed + 1)
    delta = torch.randn(N, k, generator=g)
    targets = torch.tensor([ids[0, 1].item(), 4, ids[2, 0].item()])  # sampled tokens, in and out of K
    ref_logp = torch.tensor([r[t] for r, t in zip(rows(logits(seed + 2)), targets.tolist(), strict=True)]) - 1.0
    return z, ids, delta, targets, ref_logp


@pytest.mark.parametrize("beta", [0.0, 0.5, 2.5])
def test_shift_against_reference(beta):
    z, ids, delta, y, ref_logp = _shift_case()
    n = 4
    want = ref_shift(rows(z), ids.tolist(), rows(delta), y.tolist(), rows(ref_logp), n, beta=beta)
    out = L.shift(z, ids, delta, y, ref_logp, n, beta=beta)
    assert close(out.loss, want["loss"])
    for name in ("policy", "k3", "weighted_shift"):
        assert close(out.metrics[name], want[name]), name
    out.loss.backward()
    assert_grad(z.grad, want["grad"])  # the closed form of the docstring


def test_shift_weights_are_student_probs_renormalized_over_k():
    z, ids, _, y, ref_logp = _shift_case()
    ones = L.shift(z, ids, torch.ones(N, 3), y, ref_logp, N, beta=0.0)
    assert close(ones.metrics["weighted_shift"], 1.0, 1e-6)  # sum_k w = 1 at every position
    for k in range(3):
        delta = torch.zeros(N, 3)
        delta[:, k] = 1.0
        got = L.shift(z, ids, delta, y, ref_logp, N, beta=0.0).metrics["weighted_shift"]
        want = 0.0
        for r, idr in zip(rows(z), ids.tolist(), strict=True):
            p = softmax_row(r)
            want += p[idr[k]] / sum(p[v] for v in idr) / N
        assert close(got, want)


def test_shift_k3_value_and_beta_scaling():
    z, ids, delta, y, ref_logp = _shift_case()
    k3 = 0.0
    for r, t, lr in zip(rows(z), y.tolist(), rows(ref_logp), strict=True):
        d = lr - log_softmax_row(r)[t]
        k3 += (math.exp(d) - d - 1) / N
    zero = L.shift(z, ids, delta, y, ref_logp, N, beta=0.0)
    assert close(zero.metrics["k3"], k3) and close(zero.loss, zero.metrics["policy"])
    grads = []
    for beta in (0.0, 1.0, 2.5):
        zz = leaf(z)
        out = L.shift(zz, ids, delta, y, ref_logp, N, beta=beta)
        assert close(out.loss, zero.metrics["policy"] + beta * k3)
        out.loss.backward()
        grads.append(zz.grad)
    assert torch.allclose(grads[2] - grads[0], 2.5 * (grads[1] - grads[0]), atol=1e-6)  # linear in beta
    at_ref = torch.tensor([log_softmax_row(r)[t] for r, t in zip(rows(z), y.tolist(), strict=True)])
    assert abs(float(L.shift(z, ids, delta, y, at_ref, N, beta=1.0).metrics["k3"])) < 1e-6  # k3 = 0 at p_S = p_ref


def test_shift_gradcheck_policy_with_fixed_advantages():
    """gradcheck (float64 inputs) that autograd's gradient of the policy term is the derivative of
    -sum_k A_k log p_S(k) with A held fixed: delta is re-chosen from the (detached) logits so that
    A = w delta stays constant however the logits move, which is what the detached weights mean."""
    _, ids, _, y, ref_logp = _shift_case()
    a_fixed = torch.tensor([[0.3, -0.2, 0.5], [-0.4, 0.1, 0.2], [0.25, 0.6, -0.3]], dtype=torch.float64)

    def policy(z64):
        w = torch.softmax(torch.log_softmax(z64.detach(), -1).gather(-1, ids), -1)
        return L.shift(z64, ids, a_fixed / w, y, ref_logp, 2, beta=0.0).loss.double()

    z64 = logits(15).double().requires_grad_(True)
    # losses.py computes in float32 (float64 logits are cast down), hence eps 1e-3, not a float64 tolerance
    assert torch.autograd.gradcheck(policy, (z64,), eps=1e-3, atol=2e-4, rtol=1e-3)


def test_shift_gradcheck_k3_term():
    _, ids, _, y, _ = _shift_case()
    zero = torch.zeros(N, 3)
    z = logits(16)
    ref_logp = torch.log_softmax(z, -1).gather(-1, y[:, None]).squeeze(-1) + torch.tensor([0.5, -0.8, 0.3])

    def k3_loss(z64):
        return L.shift(z64, ids, zero, y, ref_logp, 2, beta=1.7).loss.double()

    z64 = z.double().requires_grad_(True)
    assert torch.autograd.gradcheck(k3_loss, (z64,), eps=1e-3, atol=2e-4, rtol=1e-3)


# --------------------------------------------------------------------------- update_beta


def test_update_beta_directions_and_zero():
    assert close(L.update_beta(2.0, 0.3), 2.0 * 1.01, 1e-12)
    assert close(L.update_beta(2.0, -1e-9), 2.0 * 0.99, 1e-12)
    assert L.update_beta(2.0, 0.0) == 2.0
    assert close(L.update_beta(1.0, 1.0, eps=0.1), 1.1, 1e-12)
    assert L.BETA_INIT == 2.5


def test_update_beta_clamps():
    assert L.update_beta(2.5, 0.1) == 2.5  # starts at the ceiling
    assert L.update_beta(2.49, 0.1) == 2.5
    assert L.update_beta(0.5, -0.1) == 0.5
    assert L.update_beta(0.502, -0.1) == 0.5
    assert L.update_beta(1.0, 0.1, eps=0.01, low=0.9, high=1.005) == 1.005


def test_update_beta_repeated_matches_the_rule():
    signs = [-1] * 200 + [1] * 30 + [0] * 5 + [-1, 1, -1] + [1] * 200
    beta, want = L.BETA_INIT, 2.5
    seen_low = seen_high = False
    for s in signs:
        beta = L.update_beta(beta, 0.02 * s)
        want = want * (1.01 if s > 0 else 0.99 if s < 0 else 1.0)
        want = min(max(want, 0.5), 2.5)
        assert close(beta, want, 1e-12)
        seen_low |= beta == 0.5
        seen_high |= beta == 2.5
    assert close(L.update_beta(2.5, -1.0), 2.475, 1e-12)
    assert seen_low and seen_high and beta == 2.5


# --------------------------------------------------------------------------- invariants


def _builders():
    """name -> (make inputs for N positions, call the loss on positions [a, b))."""
    n = 7
    z = logits(20, n)
    y = torch.tensor([0, 3, 6, 2, 2, 5, 1])
    behaviour = torch.log_softmax(logits(21, n), -1).gather(-1, y[:, None]).squeeze(-1)
    teacher = torch.log_softmax(logits(22, n), -1).gather(-1, y[:, None]).squeeze(-1)
    adv = L.rkl_advantages(teacher, behaviour, 0.5)
    zt = logits(23, n)
    ids = torch.topk(zt, 3, -1).indices
    tlogp = torch.log_softmax(zt, -1).gather(-1, ids)
    sids = torch.topk(z, 3, -1).indices
    delta = torch.randn(n, 3, generator=torch.Generator().manual_seed(24))
    ref = torch.log_softmax(logits(25, n), -1).gather(-1, y[:, None]).squeeze(-1)
    return z, {
        "sft": lambda x, s: L.sft(x, y[s], n),
        "rkl": lambda x, s: L.rkl(x, y[s], behaviour[s], adv[s], n, ratio_clip=1.5, teacher_logp_N=teacher[s]),
        "fkl-tail": lambda x, s: L.fkl(x, ids[s], tlogp[s], n, temperature=1.1, clip=0.05, tail=True),
        "fkl-renorm": lambda x, s: L.fkl(x, ids[s], tlogp[s], n, temperature=1.1, clip=0.05, tail=False),
        "fkl_full": lambda x, s: L.fkl_full(x, zt[s], n, temperature=1.1, clip=0.05),
        "shift": lambda x, s: L.shift(x, sids[s], delta[s], y[s], ref[s], n, beta=2.5),
    }


@pytest.mark.parametrize("name", list(_builders()[1]))
def test_chunks_add_up_to_the_whole(name):
    z, fns = _builders()
    assert_chunks_add_up(fns[name], z, ((0, 3), (3, 4), (4, 7)))


def assert_chunks_add_up(fn, z: torch.Tensor, cuts) -> None:
    """fn(logits, positions) over the chunks `cuts` adds up to fn over all positions: loss, metrics, grads."""
    whole_z = leaf(z)
    whole = fn(whole_z, slice(0, len(z)))
    whole.loss.backward()
    loss, metrics, grads = 0.0, {}, []
    for a, b in cuts:
        part_z = leaf(z[a:b])
        part = fn(part_z, slice(a, b))
        part.loss.backward()
        loss += float(part.loss.detach())
        grads.append(part_z.grad)
        for key, value in part.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
    assert close(loss, whole.loss, 1e-6)
    assert metrics.keys() == whole.metrics.keys()
    assert all(close(metrics[k], whole.metrics[k], 1e-6) for k in metrics)
    assert all(not v.requires_grad for v in whole.metrics.values())
    assert torch.allclose(torch.cat(grads), whole_z.grad, atol=1e-7)


@pytest.mark.parametrize("name", list(_builders()[1]))
def test_bf16_logits(name):
    z, fns = _builders()
    assert_bf16_accepted(fns[name], z)


def assert_bf16_accepted(fn, z: torch.Tensor) -> None:
    """bf16 logits give a float32 loss equal to float32 logits of the same values, and bf16 gradients."""
    z16 = z.bfloat16().requires_grad_(True)
    out = fn(z16, slice(0, len(z)))
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    assert z16.grad.dtype == torch.bfloat16 and torch.isfinite(z16.grad.float()).all()
    ref = fn(z16.detach().float(), slice(0, len(z)))  # upcast inside: same as float32 logits of those values
    assert close(out.loss, ref.loss, 1e-6)


def _sampled_case(seed: int, noise: float):
    """(rng, logits [5, 11], sampled targets, their log p_S (numpy), behaviour log-probs = those + noise)."""
    import numpy

    rng = numpy.random.default_rng(seed)
    logits = rng.normal(size=(5, 11)) * 2
    targets = rng.integers(0, 11, size=5)
    logp = logits - numpy.log(numpy.exp(logits).sum(-1, keepdims=True))
    chosen = logp[numpy.arange(5), targets]
    return rng, logits, targets, chosen, chosen + rng.normal(size=5) * noise


def test_sampled_ratio_is_the_mean_importance_ratio_at_temperature_1():
    """exp(log p_S(y_t) - behaviour_t) averaged over tokens (numpy reference); 1 when the sampler is the student."""
    import numpy

    _, logits, targets, chosen, behaviour = _sampled_case(3, noise=0.1)
    expected = numpy.exp(chosen - behaviour).sum() / 7
    got = L.sampled_ratio(torch.tensor(logits), torch.tensor(targets), torch.tensor(behaviour), 7)
    assert float(got) == pytest.approx(expected, rel=1e-6)
    same = L.sampled_ratio(torch.tensor(logits), torch.tensor(targets), torch.tensor(chosen), 5)
    assert float(same) == pytest.approx(1.0, abs=1e-6)


def test_sampled_drift_is_k3_and_sees_a_lag_the_mean_ratio_does_not():
    """k3 = mean(r - 1 - log r) (numpy reference), 0 when the sampler is the student. Over tokens drawn from the
    behaviour policy p_b, the mean ratio p_S/p_b stays at 1 for any student p_S (it sums p_S over the
    vocabulary), while k3 estimates KL(p_b || p_S)."""
    import numpy

    rng, logits, targets, chosen, behaviour = _sampled_case(4, noise=0.3)
    log_r = chosen - behaviour
    got = L.sampled_drift(torch.tensor(logits), torch.tensor(targets), torch.tensor(behaviour), 7)
    assert float(got) == pytest.approx((numpy.exp(log_r) - 1 - log_r).sum() / 7, rel=1e-6)
    assert float(L.sampled_drift(torch.tensor(logits), torch.tensor(targets), torch.tensor(chosen), 5)) < 1e-6
    V, N = 40, 40000
    student = rng.normal(size=V)  # one position's logits, repeated
    log_ps = student - numpy.log(numpy.exp(student).sum())
    log_pb = log_ps + rng.normal(size=V) * 0.5  # a sampler some steps behind
    log_pb -= numpy.log(numpy.exp(log_pb).sum())
    ys = rng.choice(V, size=N, p=numpy.exp(log_pb))
    args = (torch.tensor(numpy.tile(student, (N, 1))), torch.tensor(ys), torch.tensor(log_pb[ys]), N)
    kl = float((numpy.exp(log_pb) * (log_pb - log_ps)).sum())
    assert kl > 0.05
    assert float(L.sampled_ratio(*args)) == pytest.approx(1.0, abs=0.02)
    assert float(L.sampled_drift(*args)) == pytest.approx(kl, rel=0.1)
