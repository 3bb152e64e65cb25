"""What a new adapter version costs vLLM: `LLMEngine.add_lora` of a Qwen3-1.7B-shaped LoRA r64 (all seven
projections, 392 tensors), as opd-rollout --follow calls it for every version, with a profile of where it goes.

    python benchmarks/bench_lora_load_gpu.py --json docs/figures/lora_load_gpu.json    # one GPU, vLLM installed

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that cProfile sees the load. Each
variant writes `--versions` adapters (fp32 as opd-train saves them, and bf16) and times add_lora of each; the
first load of a variant is reported apart (it allocates the CPU cache's pinned buffers).

With `--contend`, each variant's versions are then loaded again while another process keeps the GPU busy with
bf16 matrix products (a stand-in for opd-train's step in the on-policy loop, where two processes time-share the
GPU and `add_lora` took 2.0-2.4 s against 0.07-0.09 s alone), and torch.profiler's table of the last contended
load says where the time goes. On an H100 (2026-12-07) it was CPU time: `aten::copy_` and `aten::mul_` (vLLM
scaling each lora_b on the CPU), 2-4 s a load against 3.7 ms of GPU time, each of torch's one-thread-per-core
operators waiting for the core the busy process holds. `--threads 1` loads the versions once more with that
many torch CPU threads, as opd's GPU engines run since (`engine_cpu_threads`); `--eager` skips vLLM's compile
and CUDA graphs, which a load does not touch, to start in seconds.

    python benchmarks/bench_lora_load_gpu.py --contend --eager --threads 1 --versions 4    # the A/B in one engine
    python benchmarks/bench_lora_load_gpu.py --replay 20 --threads 1    # no vLLM: add_lora's steps, GPU or CPU
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "libs" / "common"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def write_adapters(model_dir: Path, out: Path, versions: int, dtype) -> list[Path]:
    """`versions` peft folders of random LoRA r64 weights (non-zero B) in `dtype`."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(lm, LoraConfig(r=64, lora_alpha=128, target_modules=targets))
    folders = []
    for v in range(versions):
        folder = out / f"{str(dtype).split('.')[-1]}-v{v}"
        weights = {k: (torch.randn_like(t, dtype=torch.float32) * 1e-3).to(dtype).cpu()
                   for k, t in get_peft_model_state_dict(peft).items()}
        folder.mkdir(parents=True)
        save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        peft.peft_config["default"].save_pretrained(str(folder))
        folders.append(folder)
    del peft, lm
    torch.cuda.empty_cache()
    return folders


def contend(seconds: float) -> None:
    """Keep the GPU busy (8192^2 bf16 products, back to back) for `seconds`; print "ready" once running. Without
    a GPU, one core busy in a Python loop (what the GPU's busy process costs the CPU: one thread that launches
    and waits)."""
    import torch

    if not torch.cuda.is_available():
        print("ready", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    end = time.monotonic() + seconds
    for i in range(10**9):
        a @ b
        if i == 3:
            torch.cuda.synchronize()
            print("ready", flush=True)
        if i % 8 == 0:
            torch.cuda.synchronize()  # a training step's queue stays short, as here
            if time.monotonic() > end:
                return


@contextlib.contextmanager
def busy_process():
    """The --contend-worker process, running (it said "ready") for the block's duration."""
    import subprocess

    worker = subprocess.Popen([sys.executable, __file__, "--contend-worker", "600"], stdout=subprocess.PIPE, text=True)
    try:
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError("the contending process did not start")
        yield
    finally:
        worker.kill()
        worker.wait()


def replay(threads: list[int], repeats: int) -> dict:
    """vLLM's add_lora steps without vLLM (a device without its wheels): read a Qwen3-1.7B-shaped LoRA r64's
    392 fp32 tensors from safetensors, copy each into pinned memory, scale each lora_b there and copy it to the
    GPU, `repeats` times alone and `repeats` times beside the busy process, at each torch thread count. Without a
    GPU the same steps run on the CPU (no pinning; the busy process holds one core)."""
    import torch
    from safetensors.torch import load_file, save_file

    shapes = {"q_proj": (2048, 2048), "k_proj": (2048, 1024), "v_proj": (2048, 1024), "o_proj": (2048, 2048),
              "gate_proj": (2048, 6144), "up_proj": (2048, 6144), "down_proj": (6144, 2048)}
    tensors = {}
    for layer in range(28):
        for name, (fan_in, fan_out) in shapes.items():
            tensors[f"l{layer}.{name}.lora_A.weight"] = torch.randn(64, fan_in)
            tensors[f"l{layer}.{name}.lora_B.weight"] = torch.randn(fan_out, 64)
    path = Path(tempfile.mkdtemp(prefix="opd-lora-replay-")) / "adapter_model.safetensors"
    save_file(tensors, str(path))
    cuda = torch.cuda.is_available()
    slots = {k: torch.empty(v.shape, device="cuda" if cuda else "cpu") for k, v in tensors.items()}

    def load() -> float:
        t0 = time.perf_counter()
        for key, cpu in load_file(str(path)).items():
            pinned = torch.empty(cpu.shape, dtype=cpu.dtype, pin_memory=cuda)
            pinned.copy_(cpu)
            if "lora_B" in key:
                pinned.mul_(2.0)
            slots[key].copy_(pinned, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    default = torch.get_num_threads()
    out = {}
    for n in [default, *threads]:
        torch.set_num_threads(n)
        alone = [load() for _ in range(repeats)]
        with busy_process():
            busy = [load() for _ in range(repeats)]
        out[str(n)] = {"alone_s": [round(t, 4) for t in alone], "contended_s": [round(t, 4) for t in busy],
                       "median_alone_s": round(statistics.median(alone), 4),
                       "median_contended_s": round(statistics.median(busy), 4)}
        print(f"replay, {n} torch thread(s): alone {out[str(n)]['median_alone_s']:.3f} s, "
              f"beside a busy process {out[str(n)]['median_contended_s']:.3f} s", flush=True)
    torch.set_num_threads(default)
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "logical_cpus": os.cpu_count(),
            "replay": out}


def load_contended(engine, requests: list, top: int, threads: int | None = None) -> dict:
    """add_lora of each request while a second process keeps the GPU busy, with `threads` torch CPU threads
    (None: as they are); the last one profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with busy_process():
            times = []
            for i, request in enumerate(requests):
                last = i == len(requests) - 1
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if last else None
                if prof:
                    prof.__enter__()
                t0 = time.perf_counter()
                engine.add_lora(request)
                returned = time.perf_counter() - t0
                torch.cuda.synchronize()
                times.append((returned, time.perf_counter() - t0))
                if prof:
                    prof.__exit__(None, None, None)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    finally:
        torch.set_num_threads(before)
    print(table, flush=True)
    return {"torch_threads": threads or before, "returned_s": [round(r, 4) for r, _ in times],
            "synchronized_s": [round(t, 4) for _, t in times],
            "median_returned_s": round(statistics.median(r for r, _ in times), 4), "profile_table": table}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--json")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--contend", action="store_true",
                        help="also load each variant while another process keeps the GPU busy (profiled)")
    parser.add_argument("--threads", type=int, action="append", default=[],
                        help="with --contend: load the versions again with this many torch CPU threads (repeatable)")
    parser.add_argument("--eager", action="store_true", help="no compile or CUDA graphs (a faster start)")
    parser.add_argument("--replay", type=int, metavar="REPEATS",
                        help="no vLLM: replay add_lora's CPU and copy steps REPEATS times at each --threads")
    parser.add_argument("--contend-worker", type=float, help=argparse.SUPPRESS)  # the busy process itself
    args = parser.parse_args()
    if args.contend_worker:
        contend(args.contend_worker)
        return 0
    if args.replay:
        return save(replay(args.threads, args.replay), args.json)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import torch
    from bench_loop_gpu import build_models
    from vllm.lora.request import LoRARequest

    from opd_common.engines.vllm_engine import build_llm

    tmp = Path(tempfile.mkdtemp(prefix="opd-lora-load-"))
    model = build_models(tmp, tiny=False)
    variants = {"float32": write_adapters(model, tmp, args.versions, torch.float32),
                "bfloat16": write_adapters(model, tmp, args.versions, torch.bfloat16)}
    llm = build_llm(str(model), None, seed=0, dtype="auto", max_logprobs=20, memory=0.3, eager=args.eager,
                    max_model_len=4096, tokenizer=str(model), enable_lora=True, max_lora_rank=64, max_loras=2)
    engine = llm.llm_engine
    results, next_id = {}, 1
    for name, folders in variants.items():
        times, profile = [], cProfile.Profile()
        for i, folder in enumerate(folders):
            request = LoRARequest(f"{name}{i}", next_id, str(folder))
            next_id += 1
            if i == len(folders) - 1:
                profile.enable()
            t0 = time.perf_counter()
            engine.add_lora(request)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if i == len(folders) - 1:
                profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.profile_top)
        results[name] = {"first_s": round(times[0], 4), "median_after_first_s": round(statistics.median(times[1:]), 4),
                         "all_s": [round(t, 4) for t in times],
                         "adapter_bytes": sum(p.stat().st_size for p in folders[0].iterdir())}
        print(f"{name}: first {times[0]:.3f} s, then median {statistics.median(times[1:]):.3f} s "
              f"({results[name]['adapter_bytes'] / 2**20:.0f} MiB)", flush=True)
        print(text.getvalue()[:6000], flush=True)
        if args.contend:
            requests = []
            for i, folder in enumerate(folders):
                requests.append(LoRARequest(f"{name}{i}-contended", next_id, str(folder)))
                next_id += 1
            results[name]["contended"] = load_contended(engine, requests, args.profile_top)
            print(f"{name} while the GPU is busy: median {results[name]['contended']['median_returned_s']:.3f} s",
                  flush=True)
            for threads in args.threads:
                again = [LoRARequest(f"{r.lora_name}-t{threads}", next_id + i, r.lora_path)
                         for i, r in enumerate(requests)]
                next_id += len(again)
                got = results[name].setdefault("contended_threads", {})[str(threads)] = load_contended(
                    engine, again, args.profile_top, threads)
                print(f"{name} while the GPU is busy, {threads} torch thread(s): median "
                      f"{got['median_returned_s']:.3f} s", flush=True)
    figures = {"device": torch.cuda.get_device_name(), "results": results}
    print(json.dumps(figures))
    return save(figures, args.json)


def save(figures: dict, path: str | None) -> int:
    if path:
        Path(path).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
