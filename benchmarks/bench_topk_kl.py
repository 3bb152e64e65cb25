"""How far the top-k forward KL (losses.fkl) is from the full-vocabulary KL (losses.fkl_full).

    python benchmarks/bench_topk_kl.py                          # Markdown table on stdout
    python benchmarks/bench_topk_kl.py --json docs/figures/topk_kl.json --positions 256 --seed 0

Synthetic, real-shaped logits over Qwen3's vocabulary (V = 151,936), made by `make_logits`:

- teacher: a Gaussian bulk sigma * N(0, 1) over all V ids (sigma ~ U(1.5, 2.5) per position), plus a
  Zipf-like head on H = 2048 random ids, boost_i = LSE(bulk) + c - s log i for rank i = 1..H, with
  c ~ U(4, 15) (how much the head outweighs the bulk) and s ~ U(1.5, 4.5) (how fast the head decays)
  per position: top-1 mass ~0.23 to ~0.98 (5th-95th percentiles), mass outside the top-16 ~0 to
  ~18%, outside the top-256 ~0 to ~2%;
- student: the teacher plus N(0, 0.5) noise on every id, plus N(0, eta) noise on the head ids
  (eta ~ U(0.3, 1.5)) and the head's Zipf slope rescaled by U(0.7, 1.3): a per-token KL(T || S)
  of ~0.01 to ~1.2 nats (median ~0.2), a student moderately off its teacher.
The JSON records these percentiles ("logits") for the run.

For each temperature and k, the teacher's top-k ids (by teacher probability) and their float32
log-probs at temperature 1 are what a record carries (teachers.NAME.topk_ids/topk_logprobs);
`fkl` on them (tail bucket or OPSD's renormalized top-k) is compared per token with `fkl_full` on
the full logits: mean absolute error, mean relative error (|error| / |full|), bias (mean signed
error) and Pearson correlation over the positions. First without the clip (the divergences
themselves), then with the per-summand clip (0.05) on both sides. CPU only; positions are
generated and scored in chunks, and the loss functions are called one position at a time, so
per-token values come straight out of the library's functions.

Two more things are measured for the tail bucket at every temperature:

- the previous construction ("tail, teacher-side tempering"; `previous_fkl_tail` here, as losses.fkl was
  before issue 17): the teacher's (k+1) buckets tempered as a categorical, the student's exact
  softmax(logits / tau) at the ids and the exact tempered mass of the rest, compared with the full KL the same way;
- identity (teacher = student, the student's own top-k log-probs): the loss, its gradient's largest entry
  and the gradient summed over the ids outside the top-k ("tail_grad": > 0 means a descent step lowers the
  student's mass outside its top-k), for `fkl` and for the previous construction.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import torch

from opd_train import losses

VOCAB = 151_936  # Qwen3
HEAD = 2048


def make_logits(n: int, g: torch.Generator, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student logits [n, vocab] (float32) with the shapes described in the module doc."""
    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, 1, generator=g)

    teacher_NV = torch.randn(n, vocab, generator=g) * uniform(1.5, 2.5)
    lse_N1 = torch.logsumexp(teacher_NV, -1, keepdim=True)
    head_ids_NH = torch.multinomial(torch.ones(n, vocab), HEAD, generator=g)  # distinct ids
    log_rank_H = torch.arange(1, HEAD + 1, dtype=torch.float32).log()
    slope_N1 = uniform(1.5, 4.5)
    boost_NH = lse_N1 + uniform(4.0, 15.0) - slope_N1 * log_rank_H
    teacher_NV.scatter_add_(-1, head_ids_NH, boost_NH)
    student_NV = teacher_NV + 0.5 * torch.randn(n, vocab, generator=g)
    head_noise_NH = torch.randn(n, HEAD, generator=g) * uniform(0.3, 1.5)
    slope_change_NH = (uniform(0.7, 1.3) - 1.0) * -slope_N1 * log_rank_H
    student_NV.scatter_add_(-1, head_ids_NH, head_noise_NH + slope_change_NH)
    return teacher_NV, student_NV


def previous_fkl_tail(logits_NV: torch.Tensor, ids_NK: torch.Tensor, teacher_logp_NK: torch.Tensor, num_tokens: int,
                      *, temperature: float, clip: float | None) -> losses.LossOutput:
    """The tail bucket as losses.fkl built it before issue 17: the teacher's (k+1) buckets tempered as one
    categorical, the student's exact tempered probabilities at the ids and outside them (not zero at identity)."""
    s_NV = logits_NV.float() / temperature
    student_NV = torch.log_softmax(s_NV, -1)
    rest_NV = student_NV.scatter(-1, ids_NK, torch.finfo(torch.float32).min / 4)
    student_NB = torch.cat([student_NV.gather(-1, ids_NK), torch.logsumexp(rest_NV, -1, keepdim=True)], -1)
    mass_N = (1.0 - teacher_logp_NK.exp().sum(-1)).clamp(min=0.0)
    teacher_NB = torch.log_softmax(torch.cat([teacher_logp_NK, mass_N.log().unsqueeze(-1)], -1) / temperature, -1)
    p_NB = teacher_NB.exp()
    j_NB = torch.where(p_NB > 0, p_NB * (teacher_NB - student_NB), torch.zeros_like(p_NB))
    if clip is not None:
        j_NB = torch.minimum(j_NB, torch.full_like(j_NB, clip))
    return losses.LossOutput(j_NB.sum() / num_tokens, {})


def per_token(fn, n: int) -> list[float]:
    """fn(i) -> LossOutput for position i alone (num_tokens = 1): its loss is that token's value."""
    return [float(fn(i).loss) for i in range(n)]


def summarize(topk: list[float], full: list[float]) -> dict[str, float]:
    n = len(full)
    err = [a - b for a, b in zip(topk, full, strict=True)]
    mean_a, mean_b = sum(topk) / n, sum(full) / n
    cov = sum((a - mean_a) * (b - mean_b) for a, b in zip(topk, full, strict=True))
    var_a = sum((a - mean_a) ** 2 for a in topk)
    var_b = sum((b - mean_b) ** 2 for b in full)
    return {"mean_full": mean_b, "mean_topk": mean_a, "bias": sum(err) / n,
            "mae": sum(abs(e) for e in err) / n,
            "mean_rel_err": sum(abs(e) / max(abs(b), 1e-9) for e, b in zip(err, full, strict=True)) / n,
            "corr": cov / math.sqrt(var_a * var_b) if var_a > 0 and var_b > 0 else float("nan")}


def quantiles(values: list[float], qs=(0.05, 0.25, 0.5, 0.75, 0.95)) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {f"p{int(q * 100):02d}": float(t.quantile(q)) for q in qs}


VARIANTS = {"tail": lambda *a, **kw: losses.fkl(*a, **kw, tail=True),
            "renormalized": lambda *a, **kw: losses.fkl(*a, **kw, tail=False),
            "tail-previous": previous_fkl_tail}


def score_chunk(teacher_NV: torch.Tensor, student_NV: torch.Tensor, ks: list[int], temps: list[float],
                clips: list[float | None]) -> dict[tuple, list[float]]:
    """Per-token values: key (tau, clip) for fkl_full, (tau, clip, k, variant) for the top-k variants."""
    n = teacher_NV.shape[0]
    ids_NK = torch.topk(teacher_NV, ks[-1], -1).indices  # sorted: each smaller k is a prefix
    logp_NK = torch.log_softmax(teacher_NV, -1).gather(-1, ids_NK)  # what a record carries (float32)
    out: dict[tuple, list[float]] = {}
    for tau in temps:
        for clip in clips:
            out[(tau, clip)] = per_token(lambda i: losses.fkl_full(
                student_NV[i:i + 1], teacher_NV[i:i + 1], 1, temperature=tau, clip=clip), n)
            for k in ks:
                for name, fn in VARIANTS.items():
                    out[(tau, clip, k, name)] = per_token(lambda i, fn=fn, k=k: fn(
                        student_NV[i:i + 1], ids_NK[i:i + 1, :k], logp_NK[i:i + 1, :k], 1,
                        temperature=tau, clip=clip), n)
    return out


def identity_chunk(student_NV: torch.Tensor, ks: list[int], temps: list[float],
                   clips: list[float | None]) -> dict[tuple, list[tuple[float, float, float]]]:
    """Teacher = student: per token (loss, max |grad|, gradient summed outside the top-k), key (tau, clip, k,
    variant); the teacher's log-probs are the student's own, logit - logsumexp as opd-score's hf teacher writes."""
    n = student_NV.shape[0]
    ids_NK = torch.topk(student_NV, ks[-1], -1).indices
    logp_NK = student_NV.gather(-1, ids_NK) - torch.logsumexp(student_NV, -1, keepdim=True)
    out: dict[tuple, list[tuple[float, float, float]]] = {}
    with torch.enable_grad():
        for tau in temps:
            for clip in clips:
                for k in ks:
                    for name in ("tail", "tail-previous"):
                        vals = []
                        for i in range(n):
                            z = student_NV[i:i + 1].clone().requires_grad_(True)
                            loss = VARIANTS[name](z, ids_NK[i:i + 1, :k], logp_NK[i:i + 1, :k], 1,
                                                  temperature=tau, clip=clip).loss
                            loss.backward()
                            g = z.grad[0]
                            outside = g.sum() - g[ids_NK[i, :k]].sum()
                            vals.append((float(loss.detach()), float(g.abs().max()), float(outside)))
                        out[(tau, clip, k, name)] = vals
    return out


def logit_stats(teacher_NV: torch.Tensor, ks: list[int]) -> dict[str, list[float]]:
    """Teacher top-1 mass and mass outside the top-k, per position."""
    p_NK = torch.topk(torch.softmax(teacher_NV, -1), ks[-1], -1).values
    stats = {"top1_mass": p_NK[:, 0].tolist()}
    for k in ks:
        stats[f"tail_mass_k{k}"] = (1.0 - p_NK[:, :k].sum(-1)).clamp(min=0).tolist()
    return stats


def measure(args) -> dict:
    ks = sorted(int(k) for k in args.ks.split(","))
    temps = [float(t) for t in args.temperatures.split(",")]
    g = torch.Generator().manual_seed(args.seed)
    values: dict[tuple, list[float]] = {}
    stats: dict[str, list[float]] = {}
    identity: dict[tuple, list[tuple[float, float, float]]] = {}
    done = 0
    while done < args.positions:
        teacher_NV, student_NV = make_logits(min(args.chunk, args.positions - done), g)
        for key, vals in score_chunk(teacher_NV, student_NV, ks, temps, [None, args.clip]).items():
            values.setdefault(key, []).extend(vals)
        if done < args.identity_positions:
            part = student_NV[:args.identity_positions - done]
            for key, vals in identity_chunk(part, ks, temps, [None, args.clip]).items():
                identity.setdefault(key, []).extend(vals)
        for key, vals in logit_stats(teacher_NV, ks).items():
            stats.setdefault(key, []).extend(vals)
        done += teacher_NV.shape[0]
        print(f"{done}/{args.positions} positions", file=sys.stderr)
    for tau in temps:
        stats[f"kl_full_tau{tau:g}"] = values[(tau, None)]
    order = list(VARIANTS)
    rows = [{"temperature": key[0], "clip": key[1], "k": key[2], "variant": key[3],
             **summarize(vals, values[key[:2]])} for key, vals in values.items() if len(key) == 4]
    rows.sort(key=lambda r: (r["clip"] is not None, r["temperature"], r["k"], order.index(r["variant"])))
    ident = [{"temperature": key[0], "clip": key[1], "k": key[2], "variant": key[3], "positions": len(vals),
              "mean_loss": sum(v[0] for v in vals) / len(vals), "max_abs_loss": max(abs(v[0]) for v in vals),
              "max_abs_grad": max(v[1] for v in vals), "mean_tail_grad": sum(v[2] for v in vals) / len(vals)}
             for key, vals in identity.items()]
    ident.sort(key=lambda r: (r["clip"] is not None, r["temperature"], r["k"], order.index(r["variant"])))
    return {"rows": rows, "identity": ident, "logits": {name: quantiles(v) for name, v in stats.items()}}


NAMES = {"tail": "tail bucket", "renormalized": "renormalized", "tail-previous": "tail, teacher-side tempering"}


def table(rows: list[dict]) -> str:
    lines = ["| clip | tau | k | variant | mean full KL | mean top-k | bias | MAE | mean rel. err | corr |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clip'] if r['clip'] is not None else 'off'} | {r['temperature']:g} | {r['k']} | "
                     f"{NAMES[r['variant']]} | {r['mean_full']:.4f} | "
                     f"{r['mean_topk']:.4f} | {r['bias']:+.4f} | {r['mae']:.4f} | {r['mean_rel_err']:.1%} | "
                     f"{r['corr']:.4f} |")
    return "\n".join(lines)


def identity_table(rows: list[dict]) -> str:
    lines = ["| clip | tau | k | variant | mean loss | max abs loss | max abs grad | mean tail grad |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clip'] if r['clip'] is not None else 'off'} | {r['temperature']:g} | {r['k']} | "
                     f"{NAMES[r['variant']]} | {r['mean_loss']:.2e} | {r['max_abs_loss']:.2e} | "
                     f"{r['max_abs_grad']:.2e} | {r['mean_tail_grad']:+.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", default="docs/figures/topk_kl.json",
                        help="write the figures to this JSON file ('' = do not write)")
    parser.add_argument("--positions", type=int, default=256, help="token positions (rows of logits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=32, help="positions generated at a time (memory bound)")
    parser.add_argument("--ks", default="16,64,256", help="comma-separated top-k widths")
    parser.add_argument("--temperatures", default="0.7,1.0,1.1,1.5", help="comma-separated loss temperatures")
    parser.add_argument("--identity-positions", type=int, default=64,
                        help="positions of the teacher = student check (each with a backward pass)")
    parser.add_argument("--clip", type=float, default=0.05, help="per-summand clip of the clipped comparison")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    with torch.no_grad():
        result = measure(args)
    seconds = time.perf_counter() - t0
    print(table(result["rows"]))
    print()
    print(identity_table(result["identity"]))
    if args.json:
        meta = {"script": "benchmarks/bench_topk_kl.py", "vocab": VOCAB, "positions": args.positions,
                "seed": args.seed, "ks": args.ks, "temperatures": args.temperatures, "clip": args.clip,
                "identity_positions": args.identity_positions,
                "torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor(),
                "seconds": round(seconds, 1)}
        with open(args.json, "w") as f:
            json.dump({"config": meta, "logits": result["logits"], "results": result["rows"],
                       "identity": result["identity"]}, f, indent=2)
            f.write("\n")
    print(f"{seconds:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
