"""opd-score's hf teacher on a Qwen3-1.7B-shaped model (random weights): tokens/s, MFU, peak memory.

Records of --prompt-len prompt tokens + --response-len response tokens (random ids), scored by
the same `HfTeacher` code opd-score runs, in these modes:

  plain      a plain `model(input_ids).logits` forward (bf16 logits at every position), for comparison
  a          log-probs of the sampled tokens (full-vocabulary normalized)
  b          (a) + log-probs at 16 student top-k ids (--at-student-topk)
  c          two teachers (Direct-OPD shift: post and pre, both at the 16 ids)

each eager and with --compile. tokens/s counts response tokens (what a user gets scored);
MFU = 2 x parameters x tokens/s / 989e12 (the H200's dense bf16 figure), from response tokens
only, so prompt tokens are work done for free. Peak memory is torch.cuda.max_memory_allocated
during the mode, with the weights' size beside it; the fp32 [tokens x vocab] tensor that a
whole-batch log_softmax would allocate is printed for scale.

    python benchmarks/bench_score_gpu.py --json docs/figures/score_gpu.json
    python benchmarks/bench_score_gpu.py --tiny     # CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

H200_BF16_FLOPS = 989e12


def model_config(tiny: bool):
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096)
    return Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--budgets", default="36864,73728", help="token budgets (padded tokens per forward)")
    parser.add_argument("--logit-chunk", type=int, default=4096)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="plain,a,b,c")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU (smoke run)")
    parser.add_argument("--json", help="write the figures here (rewritten after every measurement)")
    args = parser.parse_args()

    import numpy as np
    import torch
    from transformers import Qwen3ForCausalLM

    from opd_score.teacher_hf import HfTeacher, Sequence

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = model_config(args.tiny)
    if args.tiny:
        args.records, args.prompt_len, args.response_len, args.budgets = 8, 16, 64, "320,640"
        args.logit_chunk, args.repeats, args.no_compile = 128, 1, True

    def build(seed: int):
        torch.manual_seed(seed)
        with torch.device(device):
            return Qwen3ForCausalLM(config).to(dtype).eval()

    rng = np.random.default_rng(0)
    V = config.vocab_size
    seqs = [Sequence(context_ids=rng.integers(0, V, args.prompt_len),
                     response_ids=rng.integers(0, V, args.response_len),
                     at_ids=rng.integers(0, V, (args.response_len, args.k))) for _ in range(args.records)]
    plain_seqs = [Sequence(s.context_ids, s.response_ids) for s in seqs]
    response_tokens = args.records * args.response_len

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def measure(fn) -> tuple[float, float]:
        """Seconds per call (after one warm-up call) and peak GiB during the calls."""
        fn()
        sync()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        sync()
        seconds = (time.perf_counter() - t0) / args.repeats
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        return seconds, peak

    lm = build(0)
    params = sum(p.numel() for p in lm.parameters())
    weights_gib = sum(p.numel() * p.element_size() for p in lm.parameters()) / 2**30
    figures = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "parameters": params, "weights_gib": round(weights_gib, 2),
        "records": args.records, "prompt_len": args.prompt_len, "response_len": args.response_len,
        "logit_chunk": args.logit_chunk, "k": args.k,
        "fp32_full_logits_gib_per_32k_tokens": round(32768 * V * 4 / 2**30, 1),
        "runs": [],
    }

    def record(mode: str, compiled: bool, budget: int, seconds: float, peak: float, tokens: int, models: int = 1):
        tps = tokens / seconds
        row = {"mode": mode, "compile": compiled, "token_budget": budget, "seconds": round(seconds, 4),
               "response_tokens_per_s": round(tps), "mfu": round(2 * params * models * tps / H200_BF16_FLOPS, 4),
               "peak_gib": round(peak, 2), "peak_over_weights_gib": round(peak - weights_gib * models, 2)}
        figures["runs"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)

    modes = args.modes.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    if "plain" in modes:
        width = args.prompt_len + args.response_len
        batch = max(1, budgets[0] // width)
        ids = torch.from_numpy(rng.integers(0, V, (batch, width))).to(device)

        def plain():
            with torch.inference_mode():
                _ = lm(input_ids=ids).logits  # the forward pass is what is timed

        s, p = measure(plain)
        record("plain", False, batch * width, s, p, batch * args.response_len)

    for compiled in ([False] if args.no_compile else [False, True]):
        for budget in budgets:
            cfg = SimpleNamespace(token_budget=budget, logit_chunk=args.logit_chunk, compile=compiled)
            teacher = HfTeacher.from_lm(lm, cfg, device)
            if "a" in modes:
                s, p = measure(lambda: teacher.score(plain_seqs))
                record("a", compiled, budget, s, p, response_tokens)
            if "b" in modes:
                s, p = measure(lambda: teacher.score(seqs))
                record("b", compiled, budget, s, p, response_tokens)
            if "c" in modes and budget == budgets[-1]:
                pre_lm = build(1)
                pre = HfTeacher.from_lm(pre_lm, cfg, device)
                s, p = measure(lambda: (teacher.score(seqs), pre.score(seqs)))
                record("c", compiled, budget, s, p, response_tokens, models=2)
                del pre, pre_lm
                if device == "cuda":
                    torch.cuda.empty_cache()
            if compiled:
                torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
