"""opd-rollout (vllm engine) against raw vllm.LLM.generate on the same prompts, in one process.

Both paths share one engine (so engine start-up is not counted) and the same per-sample seeds,
so they generate the same tokens; the wrapper also renders prompts, builds and writes records
(packed, zstd shards). Reports response tokens/s of each and the ratio (target >= 0.9).

    python benchmarks/bench_rollout_cpu.py [--model DIR] [--n 8] [--max-tokens 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def raw_generate(llm, prompts, seeds, args):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(n=1, temperature=1.0, max_tokens=args.max_tokens, seed=s, logprobs=0) for s in seeds]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), seconds


def wrapped_generate(engine, config, out_dir):
    from opd_common.streams import ManifestInfo, ShardWriter
    from opd_rollout.run import run

    engine.tokens_generated = 0
    t0 = time.perf_counter()
    with ShardWriter(out_dir, ManifestInfo("bench"), overwrite=True) as writer:
        run(config, ["aime24"], writer, engine=engine)
    return engine.tokens_generated, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder [default: build a tiny model]")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from opd_common.datasets import bundled_path
    from opd_common.engines import derive_seed
    from opd_common.engines.vllm_engine import VllmEngine
    from opd_common.models import load_tokenizer, render_chat
    from opd_common.prompts import render_message
    from opd_common.streams import iter_inputs
    from opd_rollout.config import RolloutConfig

    tmp = tempfile.mkdtemp(prefix="opd-bench-")
    model = args.model
    if not model:
        from opd_common.tiny import build_tiny

        model = str(build_tiny(os.path.join(tmp, "tiny")))
    config = RolloutConfig(model=model, engine="vllm", n=args.n, max_tokens=args.max_tokens, quiet=True,
                           max_model_len=2048)
    engine = VllmEngine(config)
    tok = load_tokenizer(model)
    prompts, seeds = [], []
    for row, where in iter_inputs([str(bundled_path("aime24"))], check=False):
        ids = render_chat(tok, render_message(config.template, row, "problem", where), True)
        for s in range(args.n):
            prompts.append(ids)
            seeds.append(derive_seed(config.seed, row["id"], s))
    raw_generate(engine.llm, prompts[:8], seeds[:8], args)  # warm-up
    results = {"raw": [], "opd": []}
    for _ in range(args.repeats):
        for name in ("raw", "opd"):
            if name == "raw":
                tokens, seconds = raw_generate(engine.llm, prompts, seeds, args)
            else:
                tokens, seconds = wrapped_generate(engine, config, os.path.join(tmp, "out"))
            results[name].append(tokens / seconds)
            print(f"{name:4s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tok/s", file=sys.stderr)
    best = {k: max(v) for k, v in results.items()}
    figures = {"samples": len(prompts), "max_tokens": args.max_tokens, "raw_tok_s": best["raw"],
               "opd_tok_s": best["opd"], "ratio": best["opd"] / best["raw"], "all": results}
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
