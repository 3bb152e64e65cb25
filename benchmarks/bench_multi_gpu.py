"""opd-train on several GPUs (issue 8): one process vs `accelerate launch` DDP and FSDP2, same global batch.

Builds a Qwen3-1.7B-shaped student (random weights, real config, bf16) and scored records of
--prompt-len + --response-len tokens with top-16 teacher data, then runs the real CLI:

    opd-train RECORDS --loss fkl --lora-r 64 ...                        (CUDA_VISIBLE_DEVICES=0)
    accelerate launch --config_file ddp.yaml  -m opd_train.cli RECORDS ...   (--gpus G processes)
    accelerate launch --config_file fsdp.yaml -m opd_train.cli RECORDS ...   (fsdp_version 2)

and reports, per run, the median tokens/s (step 1 left out), the scaling efficiency against one GPU
(tokens/s at G GPUs / (G x tokens/s at 1)), and how far each step's loss and grad norm and the final
adapter are from the one-process run. In bf16 on GPU, compare with "again" (one process run a second
time): that is the run-to-run noise floor.

    python benchmarks/bench_multi_gpu.py --gpus 2 --json multi_gpu.json      # NCCL_NVLS_ENABLE=0 is set
    python benchmarks/bench_multi_gpu.py --gpus 1 --json one_gpu.json        # FSDP2 on a world of one
    python benchmarks/bench_multi_gpu.py --tiny --gpus 2                     # CPU smoke run (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def build_model(out: Path, tiny: bool, device: str) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_score_gpu import model_config

    from opd_common.tiny import build_tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(model_config(tiny))
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    del model


def build_records(path: Path, n: int, prompt_len: int, response_len: int, vocab: int, k: int = 16) -> None:
    import numpy as np

    from opd_common.records import SCHEMA, make_id
    from opd_common.rundir import atomic_write_bytes
    from opd_common.streams import encode

    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        logits = rng.standard_normal((response_len, k + 1)).astype(np.float32) * 2
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))  # k ids + the rest: a real distribution
        topk_ids = rng.integers(0, vocab, (response_len, k), dtype=np.int64)
        response = topk_ids[:, 0].copy()
        rec = {
            "schema": SCHEMA, "id": make_id(f"p{i}", 0), "prompt_id": f"p{i}", "sample": 0, "group_size": 1,
            "example": {"problem": f"p{i}"},
            "policy": {"model": "bench", "revision": None, "adapter": None, "version": 0},
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": response_len, "seed": i,
                         "engine": "bench", "logprobs": "raw", "thinking": False},
            "prompt_ids": rng.integers(0, vocab, prompt_len).tolist(), "response_ids": response.tolist(),
            "finish_reason": "length", "response_text": "",
            "logprobs": logp[:, 0].astype(np.float32),
            "teachers": {"t": {"model": "bench", "revision": None, "adapter": None, "prompt": "as-is",
                               "logprobs": logp[:, 0].astype(np.float32), "topk_ids": topk_ids,
                               "topk_logprobs": logp[:, :k].astype(np.float32)}},
        }
        lines.append(encode(rec, "json"))
    atomic_write_bytes(path, b"".join(lines))


def run(kind: str, gpus: int, work: Path, args: list[str], cpu: bool) -> dict:
    """One training run; returns its wall time, metrics rows and final adapter path (or the error)."""
    out = work / f"run-{kind}"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TOKENIZERS_PARALLELISM": "false"}
    if kind in ("one", "again"):  # "again": one process once more, the run-to-run noise floor on GPU
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        cmd = [sys.executable, "-m", "opd_train.cli", *args, "--out", str(out)]
    else:
        from opd_train.distributed import accelerate_config

        config = accelerate_config(kind, gpus)
        path = work / f"accelerate-{kind}.yaml"
        path.write_text(json.dumps(config))  # YAML reads JSON
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path), "-m", "opd_train.cli",
               *args, "--out", str(out)]
    if cpu:
        cmd.extend(["--device", "cpu"])
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    result = {"kind": kind, "gpus": 1 if kind in ("one", "again") else gpus, "command": " ".join(cmd),
              "wall_s": round(wall, 1), "returncode": done.returncode}
    if done.returncode != 0:
        result["error"] = done.stderr[-4000:]
        return result
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result["rows"] = rows
    result["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rows[1:] or rows)
    result["adapter"] = str(out / (out / "latest").read_text().strip() / "adapter_model.safetensors")
    return result


def compare(one: dict, other: dict) -> dict:
    """Largest relative difference of loss and grad norm per step, and of the final adapter's tensors."""
    from safetensors.torch import load_file

    rel = lambda a, b: abs(a - b) / max(abs(a), 1e-12)  # noqa: E731
    steps = [{"step": a["step"], "loss": rel(a["loss"], b["loss"]), "grad_norm": rel(a["grad_norm"], b["grad_norm"])}
             for a, b in zip(one["rows"], other["rows"], strict=True)]
    want, got = load_file(one["adapter"]), load_file(other["adapter"])
    assert want.keys() == got.keys(), "adapters with different tensors"
    worst = max(float((w.float() - got[key].float()).norm() / w.float().norm().clamp_min(1e-12))
                for key, w in want.items())
    return {"max_rel_loss": max(s["loss"] for s in steps), "max_rel_grad_norm": max(s["grad_norm"] for s in steps),
            "max_rel_adapter": worst, "per_step": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2, help="processes for the DDP and FSDP runs")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--records", type=int, default=32, help="records per optimizer step (the global batch)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--micro-batch-tokens", type=int, default=16 * 1152, help="per rank, per pass")
    parser.add_argument("--kinds", default="one,again,ddp,fsdp",
                        help="one = one process; again = one process once more (the noise floor); ddp; fsdp")
    parser.add_argument("--extra", default="", help="more opd-train flags, e.g. --compile")
    parser.add_argument("--work", default="/tmp/opd-bench-multi-gpu")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, gloo")
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    cpu = args.tiny or not torch.cuda.is_available()
    if args.tiny:
        args.steps, args.records, args.prompt_len, args.response_len, args.micro_batch_tokens = 3, 4, 8, 32, 80
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, records = work / "model", work / "records.jsonl"
    t0 = time.perf_counter()
    if not (model / "tokenizer.json").exists():  # written last
        build_model(model, args.tiny, "cpu" if cpu else "cuda")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    build_records(records, args.steps * args.records, args.prompt_len, args.response_len, min(vocab, 2048))
    print(f"model and records in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    train = [str(records), "--model", str(model), "--loss", "fkl", "--max-steps", str(args.steps),
             "--batch-size", str(args.records), "--micro-batch-tokens", str(args.micro_batch_tokens),
             "--lora-r", "64", "--lora-alpha", "128", "--lora-targets", "all-linear", "--lr", "1e-5",
             "--save-every", str(args.steps), "--quiet", *args.extra.split()]
    results = {}
    for kind in args.kinds.split(","):
        results[kind] = run(kind, args.gpus, work, train, cpu)
        r = results[kind]
        print(f"{kind}: rc {r['returncode']}, {r['wall_s']} s, tokens/s {r.get('tokens_per_s')}", file=sys.stderr)
        if "error" in r:
            print(r["error"][-1500:], file=sys.stderr)
    summary = {"device": torch.cuda.get_device_name(0) if not cpu else "cpu", "gpus": args.gpus,
               "args": vars(args), "runs": {}}
    one = results.get("one")
    for kind, r in results.items():
        entry = {k: v for k, v in r.items() if k not in ("rows", "adapter")}
        if one and "rows" in one and "rows" in r and kind != "one":
            entry["vs_one"] = compare(one, r)
            if r["gpus"] > 1:
                entry["scaling_efficiency"] = r["tokens_per_s"] / (r["gpus"] * one["tokens_per_s"])
        summary["runs"][kind] = entry
    text = json.dumps(summary, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
