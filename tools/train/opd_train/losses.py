"""The objectives of docs/losses.md as pure functions (tensors in, LossOutput out); objectives.py says which
loss each `--loss` calls, with which tensors and options (docs/architecture.md, Objectives).

Conventions, shared by every loss:

- Inputs are one chunk of N response positions: ``logits_NV`` (any float dtype; upcast to
  float32 inside), the sampled tokens ``targets_N`` and per-token data aligned to them.
- ``num_tokens`` is the number of response tokens in the whole optimizer step (all
  micro-batches, all ranks). Every loss is ``sum over the chunk's tokens / num_tokens``, so the
  losses (and gradients) of the chunks of a step add up to the global token mean, however the
  step is cut into micro-batches and chunks.
- ``metrics`` hold detached contributions on the same scale (sum / num_tokens): adding them up
  over the chunks of a step gives the step's token means.

Equations are written per token t; m_t (the response mask) is implicit: only response
positions are passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BETA_INIT = 2.5


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, torch.Tensor]  # name -> detached scalar contribution (sum / num_tokens)


def token_logprobs(logits_NV: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at `ids` ([N] or [N, K]), in float32."""
    logp_NV = torch.log_softmax(logits_NV.float() / temperature, dim=-1)
    if ids.dim() == 1:
        return logp_NV.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    return logp_NV.gather(-1, ids.long())


def sft(logits_NV: torch.Tensor, targets_N: torch.Tensor, num_tokens: int) -> LossOutput:
    """Cross-entropy on the response tokens: loss = -sum_t log p_S(y_t) / #tokens."""
    nll = -token_logprobs(logits_NV, targets_N).sum() / num_tokens
    return LossOutput(nll, {"nll": nll.detach()})


def rkl_advantages(teacher_logp_T: torch.Tensor, behaviour_logp_T: torch.Tensor, discount: float = 0.0) -> torch.Tensor:
    """Per-token advantages of on-policy distillation for one response.

    r_t = log p_T(y_t) - log p_S_old(y_t)  (minus the sampled-token reverse KL), and
    A_t = sum_{s >= t} discount^(s - t) r_s  (A_t = r_t when discount = 0).
    """
    return _discounted(teacher_logp_T.double() - behaviour_logp_T.double(), discount)


def _discounted(r_T: torch.Tensor, discount: float) -> torch.Tensor:
    """A_t = sum_{s >= t} discount^(s - t) r_s of float64 rewards, as float32 (A = r when discount = 0)."""
    if discount == 0.0:
        return r_T.float()
    out = torch.empty_like(r_T)
    running = 0.0
    values = r_T.tolist()
    for t in range(len(values) - 1, -1, -1):
        running = values[t] + discount * running
        out[t] = running
    return out.float()


def chunk_advantages(chunk_teacher_logp_C: torch.Tensor, behaviour_logp_T: torch.Tensor, student_end_C: torch.Tensor,
                     discount: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """rkl's advantages over aligned chunks (a teacher with another tokenizer; docs/losses.md, Aligned chunks).

    Chunk c covers student tokens [e_{c-1}, e_c) (e = student_end_C, e_{-1} = 0), n_c of them:
    r_c = log p_T(c) - sum_{t in c} log p_S_old(y_t), spread evenly, r_t = r_c / n_c for t in c, and r_t = 0
    for tokens in no chunk; A_t = sum_{s >= t} discount^(s - t) r_s. Returns (A_T, the per-token teacher share
    log p_S_old(y_t) + r_t, which the reverse_kl metric reads). One-token chunks give rkl_advantages exactly.
    """
    b_T = behaviour_logp_T.double()
    r_T = torch.zeros_like(b_T)
    ends = student_end_C.long()
    if len(ends):
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        n_C = ends - starts
        chunk_of = torch.repeat_interleave(torch.arange(len(ends)), n_C)
        b_C = torch.zeros(len(ends), dtype=torch.float64).index_add_(0, chunk_of, b_T[:int(ends[-1])])
        r_C = chunk_teacher_logp_C.double() - b_C
        r_T[:int(ends[-1])] = (r_C / n_C.double())[chunk_of]
    return _discounted(r_T, discount), (b_T + r_T).float()


def uld(logits_NV: torch.Tensor, teacher_probs_NK: torch.Tensor, weight_N: torch.Tensor,
        num_tokens: int) -> LossOutput:
    """Vocabulary-free top-k distillation (ULD-style), for a teacher with another vocabulary.

    At each position with weight w_t (1 where an aligned chunk starts: both models predict what follows the
    same text), the distance between the sorted top-k probability vectors:
    d_t = sum_{i <= k} | p_S^(i) - p_T^(i) |,  p^(i) the i-th largest probability (teacher: from the record,
    sorted); loss = sum_t w_t d_t / #tokens. Zero when the sorted top-k probabilities agree. Metric: uld.
    """
    k = teacher_probs_NK.shape[-1]
    top_NK = torch.topk(torch.softmax(logits_NV.float(), dim=-1), k, dim=-1).values
    d_N = (top_NK - teacher_probs_NK.float()).abs().sum(-1)
    loss = (weight_N.float() * d_N).sum() / num_tokens
    return LossOutput(loss, {"uld": loss.detach(), "uld_positions": weight_N.float().sum() / num_tokens})


def rkl(logits_NV: torch.Tensor, targets_N: torch.Tensor, behaviour_logp_N: torch.Tensor, advantage_N: torch.Tensor,
        num_tokens: int, *, ratio_clip: float | None = None, teacher_logp_N: torch.Tensor | None = None) -> LossOutput:
    """On-policy distillation (reverse KL through sampled-token advantages).

    rho_t = exp(log p_S(y_t) - log p_S_old(y_t)) (p_S_old: the behaviour log-probs in the record);
    loss = -sum_t A_t rho_t / #tokens, A_t detached (see rkl_advantages).
    With ratio_clip = c the ratio is truncated: its value is min(rho_t, c) and its gradient
    min(rho_t, c) * grad log p_S(y_t) (truncated importance sampling; the gradient is kept, only
    its weight is capped). rho_t = 1 when fully on-policy, so the gradient is -A_t grad log p_S.
    Metric reverse_kl is the sampled-token estimate log p_S_old(y_t) - log p_T(y_t) (from
    teacher_logp_N when given, else -A_t, which is the same when discount = 0).
    """
    logp_N = token_logprobs(logits_NV, targets_N)
    behaviour_N = behaviour_logp_N.float()
    advantage_N = advantage_N.float().detach()
    ratio_N = torch.exp(logp_N - behaviour_N)
    clipped_N = torch.zeros_like(ratio_N, dtype=torch.bool)
    if ratio_clip is not None:
        clipped_N = ratio_N.detach() > ratio_clip
        capped_N = ratio_clip * torch.exp(logp_N - logp_N.detach())  # value c, gradient c * grad log p
        ratio_N = torch.where(clipped_N, capped_N, ratio_N)
    loss = -(advantage_N * ratio_N).sum() / num_tokens
    if teacher_logp_N is not None:
        rkl_N = behaviour_N - teacher_logp_N.float()
    else:
        rkl_N = -advantage_N
    metrics = {"advantage": advantage_N.sum() / num_tokens, "reverse_kl": rkl_N.sum().detach() / num_tokens,
               "ratio": ratio_N.detach().sum() / num_tokens, "ratio_clipped": clipped_N.float().sum() / num_tokens}
    return LossOutput(loss, metrics)


def _clipped_sum(j_NK: torch.Tensor, clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_v min(j_v, c) per token, and whether any summand of the token was clipped."""
    if clip is None:
        return j_NK.sum(-1), torch.zeros(j_NK.shape[0], dtype=torch.bool, device=j_NK.device)
    over_NK = j_NK.detach() > clip
    return torch.minimum(j_NK, torch.full_like(j_NK, clip)).sum(-1), over_NK.any(-1)


def _kl_terms(teacher_logp_NK: torch.Tensor, student_logp_NK: torch.Tensor) -> torch.Tensor:
    """Summands p_T(v) (log p_T(v) - log p_S(v)); zero where p_T(v) = 0."""
    p_NK = teacher_logp_NK.exp()
    safe_t = torch.where(p_NK > 0, teacher_logp_NK, torch.zeros_like(teacher_logp_NK))
    return torch.where(p_NK > 0, p_NK * (safe_t - student_logp_NK), torch.zeros_like(p_NK))


TAIL_FLOOR = 1e-30  # the tail mass of an empty (k = V) or float32-unresolved tail: exp(-69), no -inf, no 0 * inf


def tail_buckets(logp_NK: torch.Tensor, empty_N: torch.Tensor,
                 exact_tail_N: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K + 1] log-probs at temperature 1 of the k ids and one tail bucket, log m with m = 1 - sum_k p(k)
    (summed in float64; TAIL_FLOOR where m <= TAIL_FLOOR or where empty_N says the ids span the vocabulary).

    fkl builds the teacher's and the student's buckets with this one construction, so identical log-probs give
    bitwise identical buckets. The student passes exact_tail_N, log of its exact mass outside the ids: the tail's
    value stays the construction's and its gradient is exact_tail_N's (the two differ by float32 rounding only).
    """
    mass_N = 1.0 - logp_NK.detach().double().exp().sum(-1)
    log_mass_N = mass_N.clamp(min=TAIL_FLOOR).log().float()
    log_mass_N = torch.where(empty_N, torch.full_like(log_mass_N, math.log(TAIL_FLOOR)), log_mass_N)
    if exact_tail_N is not None:
        straight_N = exact_tail_N - exact_tail_N.detach()  # value 0, gradient d exact_tail
        log_mass_N = log_mass_N + torch.where(empty_N, torch.zeros_like(straight_N), straight_N)
    return torch.cat([logp_NK, log_mass_N.unsqueeze(-1)], -1)


def fkl(logits_NV: torch.Tensor, ids_NK: torch.Tensor, teacher_logp_NK: torch.Tensor, num_tokens: int, *,
        temperature: float = 1.0, clip: float | None = 0.05, tail: bool = True) -> LossOutput:
    """OPSD forward KL from the teacher's top-k log-probs (teacher_logp_NK at ids_NK, temperature 1).

    Summands j_{t,v} = q_T(v) (log q_T(v) - log q_S(v)), each clipped, j <- min(j, c), then
    loss = sum_t sum_v j_{t,v} / #tokens.

    tail=True (a true KL): the k ids plus one tail bucket holding the rest of the vocabulary, the same
      construction on both sides (tail_buckets): at temperature 1, p(k) at the k ids and m = 1 - sum_k p(k) in
      the tail (teacher: the record's log-probs; student: log_softmax(logits) at the ids), then that
      (k+1)-bucket categorical is tempered, q(b) ∝ P(b)^(1/tau). Teacher = student gives exactly 0 at any
      tau; at tau = 1 this is the KL of the two bucketed distributions, and with k = V (or V - 1) the
      full-vocabulary KL at any tau. The student's tail gradient is that of its exact mass outside the ids.
    tail=False (OPSD's top-k variant): both sides renormalized over the k ids,
      q_T = softmax_k(log p_T / tau), q_S = softmax_k(logits_k / tau).
    Metrics: fkl (the unclipped divergence), fkl_clipped_frac (tokens with a clipped summand),
    teacher_tail_mass (m at temperature 1).
    """
    s_NV = logits_NV.float()
    ids_NK = ids_NK.long()
    t_NK = teacher_logp_NK.float()
    s_NK = s_NV.gather(-1, ids_NK)
    tail_mass_N = (1.0 - t_NK.exp().sum(-1)).clamp(min=0.0)
    if tail:
        empty_N = torch.zeros_like(tail_mass_N, dtype=torch.bool)
        if ids_NK.shape[-1] >= s_NV.shape[-1]:  # ids spanning the vocabulary: the tail is empty, not float32 dust
            empty_N = torch.zeros_like(s_NV, dtype=torch.bool).scatter(-1, ids_NK, True).all(-1)
            tail_mass_N = torch.where(empty_N, torch.zeros_like(tail_mass_N), tail_mass_N)
        log_z_N = torch.logsumexp(s_NV, -1)
        floor = torch.finfo(torch.float32).min / 4  # finite: a full top-k (k = V) leaves an empty tail
        exact_tail_N = torch.logsumexp(s_NV.scatter(-1, ids_NK, floor), -1) - log_z_N
        logp_NK = s_NK - log_z_N.unsqueeze(-1)  # as opd-score's hf teacher computes the record's log-probs
        student_NB = tail_buckets(logp_NK, empty_N, exact_tail_N)
        teacher_NB = tail_buckets(t_NK, empty_N)
        student_NB = torch.log_softmax(student_NB / temperature, -1)
        teacher_NB = torch.log_softmax(teacher_NB / temperature, -1)
    else:
        student_NB = torch.log_softmax(s_NK / temperature, -1)
        teacher_NB = torch.log_softmax(t_NK / temperature, -1)
    j_NB = _kl_terms(teacher_NB, student_NB)
    per_token_N, clipped_N = _clipped_sum(j_NB, clip)
    loss = per_token_N.sum() / num_tokens
    metrics = {"fkl": j_NB.detach().sum() / num_tokens, "fkl_clipped_frac": clipped_N.float().sum() / num_tokens,
               "teacher_tail_mass": tail_mass_N.sum() / num_tokens}
    return LossOutput(loss, metrics)


def fkl_full(logits_NV: torch.Tensor, teacher_logits_NV: torch.Tensor, num_tokens: int, *,
             temperature: float = 1.0, clip: float | None = 0.05) -> LossOutput:
    """Full-vocabulary forward KL (exact OPSD with an in-trainer self-teacher).

    q_T = softmax(teacher_logits / tau) (detached), q_S = softmax(logits / tau);
    j_{t,v} = q_T(v) (log q_T(v) - log q_S(v)), j <- min(j, c); loss = sum_t sum_v j / #tokens.
    Metrics: fkl (unclipped), fkl_clipped_frac.
    """
    student_NV = torch.log_softmax(logits_NV.float() / temperature, -1)
    teacher_NV = torch.log_softmax(teacher_logits_NV.detach().float() / temperature, -1)
    j_NV = _kl_terms(teacher_NV, student_NV)
    per_token_N, clipped_N = _clipped_sum(j_NV, clip)
    loss = per_token_N.sum() / num_tokens
    return LossOutput(loss, {"fkl": j_NV.detach().sum() / num_tokens,
                             "fkl_clipped_frac": clipped_N.float().sum() / num_tokens})


def sampled_ratio(logits_NV: torch.Tensor, targets_N: torch.Tensor, behaviour_logp_N: torch.Tensor,
                  num_tokens: int) -> torch.Tensor:
    """sum_t exp(log p_S(y_t) - log p_behaviour(y_t)) / #tokens at temperature 1 (no gradient): the importance
    ratio a loss without one (fkl) reports, so a loop at --max-lag >= 1 shows how far the sampler lagged."""
    return torch.exp(_sampled_log_ratio(logits_NV, targets_N, behaviour_logp_N)).sum() / num_tokens


def sampled_drift(logits_NV: torch.Tensor, targets_N: torch.Tensor, behaviour_logp_N: torch.Tensor,
                  num_tokens: int) -> torch.Tensor:
    """sum_t (r_t - 1 - log r_t) / #tokens, r_t = exp(log p_S(y_t) - log p_behaviour(y_t)) at temperature 1 (no
    gradient): k3, an estimate of KL(behaviour || student) from the sampled tokens. Each summand is >= 0 and 0
    only where the two agree, so it grows with the sampler's lag (and floors at the sampler-vs-trainer numerics
    gap) where the mean ratio does not: over tokens drawn from the behaviour policy itself, the mean of r_t is
    sum_y p_S(y) = 1 whatever the lag."""
    log_r_N = _sampled_log_ratio(logits_NV, targets_N, behaviour_logp_N)
    return (torch.exp(log_r_N) - 1.0 - log_r_N).sum() / num_tokens


def _sampled_log_ratio(logits_NV: torch.Tensor, targets_N: torch.Tensor, behaviour_logp_N: torch.Tensor):
    """log p_S(y_t) - log p_behaviour(y_t) at temperature 1, float32, no gradient."""
    logits_NV = logits_NV.detach().float()
    logp_N = logits_NV.gather(-1, targets_N.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits_NV, -1)
    return logp_N - behaviour_logp_N.float()


def shift(logits_NV: torch.Tensor, ids_NK: torch.Tensor, delta_NK: torch.Tensor, targets_N: torch.Tensor,
          ref_logp_N: torch.Tensor, num_tokens: int, *, beta: float) -> LossOutput:
    """Direct-OPD: follow the teacher's fine-tuning shift over the student's top-k ids.

    K_t = ids_NK (the student's top-k by full-vocabulary log-prob, from opd-score's shift block),
    delta_{t,k} = log pi_post(k) - log pi_pre(k),
    w_{t,k} = p_S(k) / sum_{k' in K_t} p_S(k') (detached),  A_{t,k} = w_{t,k} delta_{t,k},
    policy = -sum_t sum_k A_{t,k} log p_S(k) / #tokens, whose gradient in the logits z is
      d policy / d z_v = (p_S(v) sum_k A_{t,k} - A_{t,v} [v in K_t]) / #tokens,
    plus beta times the k3 KL to the initial student at the sampled token,
      D_t = log p_ref(y_t) - log p_S(y_t),  k3_t = exp(D_t) - D_t - 1,
    loss = policy + beta * sum_t k3_t / #tokens.
    Metrics: weighted_shift (sum_k A_{t,k}, whose step mean drives update_beta), k3, policy.
    """
    logp_NV = torch.log_softmax(logits_NV.float(), -1)
    logp_NK = logp_NV.gather(-1, ids_NK.long())
    w_NK = torch.softmax(logp_NK.detach(), -1)
    a_NK = w_NK * delta_NK.float()
    policy = -(a_NK * logp_NK).sum() / num_tokens
    d_N = ref_logp_N.float().detach() - logp_NV.gather(-1, targets_N.long().unsqueeze(-1)).squeeze(-1)
    k3 = (torch.exp(d_N) - d_N - 1).sum() / num_tokens
    loss = policy + beta * k3
    return LossOutput(loss, {"weighted_shift": a_NK.sum() / num_tokens, "k3": k3.detach(), "policy": policy.detach()})


def update_beta(beta: float, mean_weighted_shift: float, eps: float = 0.01, low: float = 0.5,
                high: float = 2.5) -> float:
    """Adaptive k3 coefficient: x(1 - eps) after a negative mean weighted shift, x(1 + eps) after
    a positive one (unchanged at 0), clamped to [low, high]."""
    if mean_weighted_shift < 0:
        beta *= 1.0 - eps
    elif mean_weighted_shift > 0:
        beta *= 1.0 + eps
    return min(max(beta, low), high)


def group_advantages(rewards_G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO/DAPO advantages of one group: A_i = (R_i - mean_g R) / (std_g R + eps), std the unbiased
    sample standard deviation (divisor G - 1); a group of one gets 0."""
    r_G = rewards_G.double()
    if r_G.numel() < 2:
        return torch.zeros_like(r_G, dtype=torch.float32)
    return ((r_G - r_G.mean()) / (r_G.std() + eps)).float()


def response_mean_weights(lengths_B: list[int]) -> list[float]:
    """Per-token weights of the GRPO paper's per-response mean for the B responses of one optimizer step (lengths
    T_i): every token of response i gets w_i = sum_j T_j / (B T_i), so that the token-sum form every loss has,
    sum_t w_t x_t / #tokens, is (1/B) sum_i (1/T_i) sum_{t in i} x_t; micro-batches and ranks still add up."""
    total, count = sum(lengths_B), len(lengths_B)
    return [total / (count * length) for length in lengths_B]


def dynamic_sampling_keep(correct_G) -> bool:
    """DAPO dynamic sampling: keep a group unless its correctness is all equal (all 0 or all 1)."""
    return len(set(float(c) for c in correct_G)) > 1


def ppo_clip(logits_NV: torch.Tensor, targets_N: torch.Tensor, behaviour_logp_N: torch.Tensor,
             advantage_N: torch.Tensor, num_tokens: int, *, clip_low: float = 0.2, clip_high: float = 0.28,
             dual_clip: float | None = 10.0, ref_logp_N: torch.Tensor | None = None,
             kl_coef: float = 0.0, token_weight_N: torch.Tensor | None = None) -> LossOutput:
    """GRPO/DAPO clipped surrogate (PPO with clip-higher and dual clip) plus an optional k3 KL.

    r_t = exp(log p_S(y_t) - log p_S_old(y_t)), A_t the group advantage of the token's response;
    pg1_t = max(-A_t r_t, -A_t clamp(r_t, 1 - clip_low, 1 + clip_high));
    pg_t = min(pg1_t, -A_t c) when A_t < 0 (dual clip c), else pg1_t;
    loss = sum_t pg_t / #tokens + kl_coef * sum_t k3_t / #tokens,  k3_t = exp(D_t) - D_t - 1,
    D_t = log p_ref(y_t) - log p_S(y_t) (the base model, adapter disabled).
    With token_weight_N (w_t, response_mean_weights) both sums are sum_t w_t (.) / #tokens instead: the
    per-response mean. Clamped or dual-clipped tokens have no gradient. Metrics: pg and k3 (with ref_logp_N) as
    they enter the loss; ratio, clip_frac, dual_clip_frac and advantage, token means.
    """
    logp_N = token_logprobs(logits_NV, targets_N)
    a_N = advantage_N.float().detach()
    ratio_N = torch.exp(logp_N - behaviour_logp_N.float().detach())
    unclipped_N = -a_N * ratio_N
    clipped_N = -a_N * ratio_N.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg1_N = torch.maximum(unclipped_N, clipped_N)
    clip_active_N = (clipped_N > unclipped_N).detach()
    pg_N = pg1_N
    dual_active_N = torch.zeros_like(clip_active_N)
    if dual_clip is not None:
        cap_N = -a_N * dual_clip
        dual_active_N = ((a_N < 0) & (pg1_N > cap_N)).detach()
        pg_N = torch.where(dual_active_N, cap_N, pg1_N)
    w_N = None if token_weight_N is None else token_weight_N.float().detach()
    pg = (pg_N if w_N is None else w_N * pg_N).sum() / num_tokens
    loss = pg
    metrics = {"pg": pg.detach(), "ratio": ratio_N.detach().sum() / num_tokens,
               "clip_frac": clip_active_N.float().sum() / num_tokens,
               "dual_clip_frac": dual_active_N.float().sum() / num_tokens, "advantage": a_N.sum() / num_tokens}
    if ref_logp_N is not None:
        d_N = ref_logp_N.float().detach() - logp_N
        k3_N = torch.exp(d_N) - d_N - 1
        k3 = (k3_N if w_N is None else w_N * k3_N).sum() / num_tokens
        if kl_coef:
            loss = loss + kl_coef * k3
        metrics["k3"] = k3.detach()
    return LossOutput(loss, metrics)
