"""Where a new adapter version's load into vLLM goes (the loop's `adapter` span, 0.5-1.0 s a step on an H100).

The rollout hands each version to vLLM with `llm_engine.add_lora` (opd_common.engines.vllm_engine), and the
engine decodes nothing while it loads. This runs that call on its own, in one process (the engine core
in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so cProfile sees the worker's side too), for a LoRA of the
loop's shape (r 64 on every linear layer, as opd-train writes it: float32) and the same weights cast to
bfloat16 beforehand (the engine's dtype: vLLM casts on load, so the samples are the same), and times what
follows: the first batch with the new version (which moves it into a GPU slot) and a second batch with it.

    python benchmarks/profile_adapter_load.py --out DIR             # one GPU, Qwen3-1.7B's shape
    VLLM_ENABLE_V1_MULTIPROCESSING=1 python benchmarks/profile_adapter_load.py --out DIR2   # as the rollout runs it
    python benchmarks/profile_adapter_load.py --tiny --out DIR      # CPU smoke run

Writes DIR/adapter_load.json (per version: dtype, add_lora seconds, the two batches' seconds; medians per
dtype) and DIR/profile.txt (cProfile of add_lora and of the first batch after it, versions 3 on).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process (cProfile)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "libs" / "common"))
sys.path.insert(0, str(ROOT / "benchmarks"))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config, rank: int, seed: int, dtype) -> None:
    """A peft LoRA folder of the trainer's shape (keys as peft's save_pretrained names them)."""
    import torch
    from safetensors.torch import save_file

    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, config.intermediate_size), "up_proj": (h, config.intermediate_size),
            "down_proj": (config.intermediate_size, h)}
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for name, (fan_in, fan_out) in dims.items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            weights[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) * 0.01).to(dtype)
            weights[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(dtype)
    path.mkdir(parents=True)
    save_file(weights, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(TARGETS), "lora_dropout": 0.0}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for adapter_load.json and profile.txt")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU model (smoke run)")
    parser.add_argument("--model", help="the model folder to use, built there first if it has no config.json")
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="sequences in each timed batch")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each timed sequence decodes")
    args = parser.parse_args()
    import torch
    from bench_loop_gpu import build_models
    from transformers import AutoConfig
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from opd_common.engines.vllm_engine import build_llm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="opd-adapter-load-"))
    if args.model and (Path(args.model) / "config.json").is_file():
        model = Path(args.model)
    else:
        model = build_models(tmp, args.tiny)
        if args.model:
            model = Path(shutil.copytree(model, args.model, dirs_exist_ok=True))
    config = AutoConfig.from_pretrained(model)
    rank = min(args.rank, 8) if args.tiny else args.rank
    adapters = []
    for v in range(1, args.versions + 1):
        dtype = torch.float32 if v % 2 else torch.bfloat16  # odd versions as opd-train writes them
        write_adapter(tmp / f"v{v}", config, rank, v, dtype)
        adapters.append((v, str(dtype).removeprefix("torch."), str(tmp / f"v{v}")))
    llm = build_llm(str(model), None, seed=0, dtype="auto", max_logprobs=20, memory=None, gpu_memory=0.25,
                    max_model_len=None if args.tiny else 4096, tokenizer=str(model), enable_lora=True,
                    max_lora_rank=max(8, rank), max_loras=3)
    calls = iter(range(1 << 30))
    params = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, temperature=1.0, seed=0)

    def batch(request) -> float:
        """One batch of prompts never seen before (no prefix-cache hit: the two batches cost the same prefill)."""
        k = next(calls)
        prompts = [TokensPrompt(prompt_token_ids=[k % 97 + 10, i] + [10 + (i * 7 + j) % 200 for j in range(62)])
                   for i in range(args.batch)]
        start = time.perf_counter()
        llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        return time.perf_counter() - start

    rows, load, first_batch = [], cProfile.Profile(), cProfile.Profile()
    for v, dtype, path in adapters:
        request = LoRARequest(f"v{v}", v, path)
        profile = v > 2
        with load if profile else contextlib.nullcontext():
            start = time.perf_counter()
            llm.llm_engine.add_lora(request)
            add = time.perf_counter() - start
        with first_batch if profile else contextlib.nullcontext():
            first = batch(request)
        rows.append({"version": v, "dtype": dtype, "add_lora_s": round(add, 4), "first_batch_s": round(first, 4),
                     "second_batch_s": round(batch(request), 4)})
        print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for dtype in ("float32", "bfloat16"):
        mine = [r for r in rows[2:] if r["dtype"] == dtype]
        summary[dtype] = {k: round(statistics.median(r[k] for r in mine), 4)
                          for k in ("add_lora_s", "first_batch_s", "second_batch_s")} if mine else {}
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {"device": device, "tiny": args.tiny, "rank": rank, "batch": args.batch, "tokens": args.tokens,
              "versions": rows, "median_after_two": summary}
    (out / "adapter_load.json").write_text(json.dumps(result, indent=1) + "\n")
    text = io.StringIO()
    for title, profiler in (("add_lora", load), ("the first batch with the new version", first_batch)):
        text.write(f"=== {title}, versions 3-{args.versions}, by cumulative time\n")
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(50)
    (out / "profile.txt").write_text(text.getvalue())
    print(json.dumps(summary), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)  # the model (unless --model) and the adapters
    return 0


if __name__ == "__main__":
    sys.exit(main())
