"""The on-policy loop as users run it: completion tokens/s, seconds per step, and where a step's time goes.

Runs whole pipelines (real processes, real pipes, the run dir as the handshake) past warm-up and reads
the stages' timelines (OPD_TIMELINE, opd_common.timeline):

  opsd  recipes/opsd.sh: opd-rollout --follow | opd-train --loss fkl --self-teacher opsd
        (32 prompts x 1 sample a step, 1,024 tokens, LoRA r64, T 1.1 / top-p 0.95 / top-k 20)
  opd   opd-rollout --follow | opd-score --teacher t=M --topk 16 | opd-train --loss fkl (an external
        teacher's top-16; 32 x 1 x 1,024)
  dapo  opd-rollout --follow -n 8 | opd-score --reward math | opd-train --loss grpo (16 prompts x 8 samples
        x 1,024; random weights never answer, so dynamic sampling would drop every group: grpo keeps them)

A run is LOOP:ENGINE:LAG (engine vllm or hf, --max-lag), or LOOP:ENGINE:LAG:mps to run it under NVIDIA's
Multi-Process Service (a daemon private to the run). For each: completion tokens/s of the loop (the
tokens the trainer trained on in steps warmup+1 .. steps over the wall-clock between the end of step
`warmup` and the end of the last), seconds per step, the time split per step (union of each stage's spans
in that window: rollout decode / adapter load / waiting for the trainer, scoring, training, the
checkpoint's snapshot and its background write, the trainer waiting for records), the importance ratio
and the drift (k3 of KL(behaviour || student)) the trainer saw, and the rollout's fraction of its memory
roofline (below). The JSON also records the machine (host CPU and load, GPU limits; benchmarks/machine.py)
and, per run, GPU 0's median clocks, power and temperature over the measured window (`gpu_during_window`,
from nvidia-smi where it exists).

    python benchmarks/bench_loop_gpu.py --json docs/figures/loop_gpu.json           # one GPU, 1.7B shape
    python benchmarks/bench_loop_gpu.py --tiny --runs opsd:hf:1,opd:vllm:1 --steps 3 --warmup 1   # CPU

Roofline of the rollout: a decode step must read the weights (bf16, the LoRA too) and every in-flight
sequence's KV cache once. With B-bar the time-weighted number of sequences in flight, c-bar the mean
context (prompt + half the response) and BW the device-to-device copy bandwidth measured at start, a
step takes at least (W + B-bar c-bar kv) / BW; the fraction is that floor times the steps decoded
(tokens / B-bar) over the time the rollout was decoding.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import GpuSampler, gpu, host, load_average

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "libs" / "common"))
# opsd:vllm:2 is recipes/opsd.sh at its default lag; the lag-1 and lag-0 runs show what the lag buys
DEFAULT_RUNS = "opsd:vllm:2,opd:vllm:2,dapo:vllm:1,opsd:vllm:1,opd:vllm:1,opsd:hf:2,opsd:vllm:0"
SHAPES = {  # loop -> (prompts a step, samples per prompt)
    "opsd": (32, 1), "opd": (32, 1), "dapo": (16, 8),
}


def build_models(tmp: Path, tiny: bool) -> Path:
    """The student (= the teacher of `opd`): a tiny CPU model, or Qwen3-1.7B's shape with random bf16 weights
    and the tiny BPE tokenizer (the vocabulary stays 151,936 ids; ids past the tokenizer decode to nothing)."""
    model = tmp / "model"
    if tiny:
        subprocess.run([sys.executable, "-m", "opd_common.tiny", str(model)], check=True, capture_output=True)
        return model
    import torch
    from bench_score_gpu import model_config  # Qwen3-1.7B's shape, as the scoring benchmark builds it
    from transformers import Qwen3ForCausalLM

    from opd_common.tiny import EOS_TOKEN, build_tokenizer

    tokenizer = build_tokenizer()
    config = model_config(tiny=False)
    config.eos_token_id, config.pad_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.pad_token_id
    config.dtype = "bfloat16"
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = Qwen3ForCausalLM(config).to(torch.bfloat16)
    lm.save_pretrained(model, safe_serialization=True)
    tokenizer.save_pretrained(model)
    del lm
    torch.cuda.empty_cache()
    return model


def copy_bandwidth() -> float | None:
    """Device-to-device copy, bytes read + written per second (the roofline's BW); None off CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return bw


def command(loop: str, engine: str, lag: int, model: Path, run_dir: Path, args) -> str:
    """The pipeline of one run, as a user would type it."""
    bin_dir = Path(sys.executable).parent
    prompts, n = SHAPES[loop]
    if args.tiny:
        prompts, n = (4, 1) if loop != "dapo" else (2, 4)
    tokens = args.max_tokens
    r = ["--engine", engine, "--quiet"]
    if engine == "vllm" and not args.tiny:
        r += ["--max-model-len", "4096"]
    if engine == "hf":
        r += ["--batch-size", str(prompts * n)]
    t = ["--micro-batch-tokens", str(args.micro_batch_tokens), "--quiet"]
    if args.train_compile:
        t.append("--compile")
    q = shlex.quote
    if loop == "opsd":
        return (f"{ROOT}/recipes/opsd.sh --no-check --bin {bin_dir} --model {model} --out {run_dir} "
                f"--steps {args.steps} "
                f"--groups {prompts} --group-size {n} --max-tokens {tokens} --engine {engine} --max-lag {lag} "
                f"--extra-rollout {q(' '.join(r[3:]))} --extra-train {q(' '.join(t))}")
    rollout = (f"{bin_dir}/opd-rollout --model {model} --follow {run_dir} --max-lag {lag} --batch-prompts {prompts} "
               f"-n {n} --max-tokens {tokens} {' '.join(r)} train-math")
    train = (f"{bin_dir}/opd-train --model {model} --out {run_dir} --max-steps {args.steps} --batch-groups {prompts} "
             f"--save-every 10 --share-policy --max-staleness {lag} --lora-r 64 --lora-alpha 128 --lr 1e-5 "
             f"{' '.join(t)}")
    if loop == "opd":
        return (f"{rollout} | {bin_dir}/opd-score --teacher t={model} --topk 16 --quiet --token-budget "
                f"{args.score_token_budget} | {train} --loss fkl")
    return f"{rollout} | {bin_dir}/opd-score --reward math --quiet | {train} --loss grpo"


def union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the intervals."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def analyse(spans: list[dict], metrics: list[dict], warmup: int, model_shape: dict, bw: float | None) -> dict:
    """The figures of one run from its timeline and metrics.jsonl."""
    steps = {s["step"]: s for s in spans if s["tool"] == "opd-train" and s["name"] == "step"}
    last = max(steps)
    lo, hi = steps[warmup]["end"], steps[last]["end"]
    measured = range(warmup + 1, last + 1)
    tokens = sum(steps[k]["tokens"] for k in measured)
    wall = hi - lo
    count = len(measured)
    split = {}
    for tool, name, label in [("opd-rollout", "decode", "rollout_decoding"), ("opd-rollout", "adapter", "adapter_load"),
                              ("opd-rollout", "wait", "rollout_waits_for_trainer"), ("opd-score", "score", "scoring"),
                              ("opd-score", "read", "scorer_waits_for_input"), ("opd-train", "step", "training"),
                              ("opd-train", "share", "policy_share"), ("opd-train", "save", "checkpoint_snapshot"),
                              ("opd-train", "save_write", "checkpoint_write_background"),
                              ("opd-train", "read", "trainer_waits_for_records")]:
        chosen = [(s["start"], s["end"]) for s in spans if s["tool"] == tool and s["name"] == name]
        if chosen:
            split[label] = round(union(chosen, lo, hi) / count, 3)
    rows = [m for m in metrics if m["step"] in measured]
    ratios = [m["ratio"] for m in rows if "ratio" in m]
    out = {"steps_measured": count, "window": [lo, hi], "completion_tokens": tokens, "wall_s": round(wall, 3),
           "completion_tokens_per_s": round(tokens / wall, 1), "seconds_per_step": round(wall / count, 3),
           "split_seconds_per_step": split,
           "trainer_step_tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in rows), 1)}
    if ratios:
        out["importance_ratio"] = {"mean": round(statistics.fmean(ratios), 5), "min": round(min(ratios), 5),
                                   "max": round(max(ratios), 5)}
    drifts = [m["drift"] for m in rows if "drift" in m]
    if drifts:  # k3 of KL(behaviour || student) at the sampled tokens: the lag, where the mean ratio stays ~1
        out["drift"] = {"mean": float(f"{statistics.fmean(drifts):.3g}"), "max": float(f"{max(drifts):.3g}")}
    out["rollout"] = rollout_figures([s for s in spans if s["tool"] == "opd-rollout" and s["name"] == "decode"],
                                     lo, hi, model_shape, bw)
    return out


def rollout_figures(decode: list[dict], lo: float, hi: float, shape: dict, bw: float | None) -> dict:
    """Decode tokens/s while decoding, sequences in flight, and the fraction of the memory roofline."""
    busy = union([(s["start"], s["end"]) for s in decode], lo, hi)
    if busy <= 0:
        return {}
    tokens = seq_seconds = prompt = samples = 0.0
    for s in decode:
        overlap = max(0.0, min(s["end"], hi) - max(s["start"], lo))
        share = overlap / max(s["end"] - s["start"], 1e-9)
        tokens += s["tokens"] * share
        seq_seconds += s.get("samples", 0) * overlap
        prompt += s.get("prompt_tokens", 0)
        samples += s.get("samples", 0)
    out = {"decode_tokens_per_s": round(tokens / busy, 1), "busy_s_per_window": round(busy, 2)}
    if samples and bw:
        in_flight = seq_seconds / busy
        context = prompt / samples + (sum(s["tokens"] for s in decode) / samples) / 2
        floor_s = (shape["weight_bytes"] + in_flight * context * shape["kv_bytes_per_token"]) / bw
        out.update(sequences_in_flight=round(in_flight, 1), mean_context=round(context),
                   roofline_step_ms=round(floor_s * 1e3, 3),
                   roofline_fraction=round((tokens / in_flight) * floor_s / busy, 3))
    return out


def model_shape(model: Path, lora_r: int) -> dict:
    config = json.loads((model / "config.json").read_text())
    h, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads, kv, hd, vocab = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
                            config["vocab_size"])
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter
    lora = layers * lora_r * (2 * (h + heads * hd) + 2 * (h + kv * hd) + 3 * (h + inter))
    params = layers * per_layer + vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return {"params": params, "weight_bytes": 2 * (params + lora), "kv_bytes_per_token": layers * 2 * kv * hd * 2}


def run_one(spec: str, model: Path, tmp: Path, args, bw) -> dict:
    """One LOOP:ENGINE:LAG[:mps] run; a run that fails is reported (its log's tail) and the next one runs."""
    loop, engine, lag, *rest = spec.split(":")
    mps = rest == ["mps"]
    if rest and not mps:
        raise SystemExit(f"--runs {spec}: expected LOOP:ENGINE:LAG or LOOP:ENGINE:LAG:mps")
    name = "-".join([loop, engine, lag, *rest])
    run_dir, timeline = tmp / f"run-{name}", tmp / f"timeline-{name}"
    for old in (run_dir, timeline):  # a --keep folder from an earlier (interrupted) run: opd-train refuses it
        shutil.rmtree(old, ignore_errors=True)
    cmd = command(loop, engine, int(lag), model, run_dir, args)
    env = dict(os.environ, OPD_TIMELINE=str(timeline))
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    log = tmp / f"log-{name}.txt"
    print(f"[{spec}] {cmd}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        with (open(log, "w") as f, mps_daemon(tmp, env) if mps else contextlib.nullcontext(),
              GpuSampler(tmp / f"gpu-{name}.csv") as sampler):
            returncode = run_pipeline(cmd, env, f, args.timeout)
    except (subprocess.SubprocessError, RuntimeError, OSError) as exc:  # timeout, the MPS daemon's start
        returncode = -1
        with open(log, "a") as f:
            f.write(f"\n{type(exc).__name__}: {exc}\n")
    total = time.perf_counter() - t0
    # the MPS daemon's own log: it shows the server started for the run's clients (a client that cannot
    # reach the daemon runs without MPS)
    mps_log = mps_log_tail(tmp) if mps else None
    result = {"run": spec, "loop": loop, "engine": engine, "max_lag": int(lag), "mps": mps, "command": cmd,
              "total_wall_s": round(total, 1), "load_average_1m_end": load_average(),
              **({"mps_log": mps_log} if mps else {})}
    error = f"exit {returncode}" if returncode != 0 else None
    if error is None:
        from opd_common.timeline import read

        try:
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            result.update(analyse(read(timeline), metrics, args.warmup, model_shape(model, 64), bw))
            if (during := sampler.summary(*result["window"])) is not None:
                result["gpu_during_window"] = during
        except (OSError, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        error += f"; its log ends:\n{log.read_text()[-3000:]}"
        print(f"[{spec}] failed: {error}", file=sys.stderr, flush=True)
        return {**result, "error": error}
    print(f"[{spec}] {result['completion_tokens_per_s']:.0f} completion tokens/s, "
          f"{result['seconds_per_step']:.2f} s/step "
          f"(total {total:.0f} s)", file=sys.stderr, flush=True)
    return result


def run_pipeline(cmd: str, env: dict, stderr, timeout: float) -> int:
    """The pipeline in its own process group: past `timeout` the whole group goes (a vLLM engine left behind
    would hold the GPU's memory through the next run)."""
    proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", cmd], env=env, stdout=subprocess.DEVNULL,
                            stderr=stderr, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    finally:  # also on Ctrl-C, and for any stage still running after the pipeline's end
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def mps_log_tail(tmp: Path) -> str:
    logs = [tmp / "mps-log" / name for name in ("control.log", "server.log")]
    return "\n".join(f"{f.name}: {f.read_text(errors='replace')[-1000:]}" for f in logs if f.exists())


@contextlib.contextmanager
def mps_daemon(tmp: Path, env: dict):
    """NVIDIA's Multi-Process Service for one run: the stages' kernels share the GPU at once instead of
    taking turns (time slices). The daemon's pipe and log folders are private to the run; it quits after."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise RuntimeError("a :mps run needs nvidia-cuda-mps-control (NVIDIA's driver utilities) on PATH")
    for key, folder in (("CUDA_MPS_PIPE_DIRECTORY", "mps-pipe"), ("CUDA_MPS_LOG_DIRECTORY", "mps-log")):
        (tmp / folder).mkdir(exist_ok=True)
        env[key] = str((tmp / folder).resolve())
    subprocess.run([control, "-d"], env=env, check=True)
    try:
        yield
    finally:
        try:
            subprocess.run([control], input=b"quit\n", env=env, timeout=60)
        except subprocess.TimeoutExpired:
            print("warning: the MPS daemon did not quit within 60 s", file=sys.stderr, flush=True)


def missing_modules(runs: str) -> list[str]:
    """What the runs need and this Python lacks (found before minutes of model writing and engine starts are
    spent): vllm for a vllm run, math_verify for the dapo loop's rewards."""
    import importlib.util

    needs = set()
    for spec in runs.split(","):
        loop, engine, *_ = spec.split(":") + [""]
        needs |= {"vllm"} if engine == "vllm" else set()
        needs |= {"math_verify"} if loop == "dapo" else set()

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):  # a finder that refuses it, a broken install
            return True

    return sorted(filter(absent, needs))


def table(results: list[dict]) -> str:
    lines = ["| run | tokens/s | s/step | decode | adapter | rollout waits | scoring | training | policy share | "
             "snapshot | write (bg) | trainer waits | ratio | roofline |", "|" + "---|" * 14]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['run']} | failed |" + " |" * 12)
            continue
        s = r["split_seconds_per_step"]
        ratio = r.get("importance_ratio", {}).get("mean", "")
        roof = r["rollout"].get("roofline_fraction", "")
        cells = [s.get(k, "") for k in ("rollout_decoding", "adapter_load", "rollout_waits_for_trainer", "scoring",
                                        "training", "policy_share", "checkpoint_snapshot",
                                        "checkpoint_write_background", "trainer_waits_for_records")]
        lines.append(f"| {r['run']} | {r['completion_tokens_per_s']:,.0f} | {r['seconds_per_step']} | "
                     + " | ".join(str(c) for c in cells) + f" | {ratio} | {roof} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=DEFAULT_RUNS,
                        help="comma-separated LOOP:ENGINE:LAG[:mps] (loops opsd, opd, dapo; :mps: under NVIDIA MPS)")
    parser.add_argument("--tiny", action="store_true", help="tiny CPU models, small shapes (the test's setting)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the figures (engine start, compile)")
    parser.add_argument("--max-tokens", type=int, default=None, help="[default: 1024; 16 with --tiny]")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--score-token-budget", type=int, default=65536)
    parser.add_argument("--train-compile", action=argparse.BooleanOptionalAction, default=None,
                        help="opd-train --compile [default: on with CUDA]")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--json", help="write the figures here (rewritten after every run)")
    parser.add_argument("--keep", help="keep models, run dirs, timelines and logs in this folder")
    args = parser.parse_args()
    if args.max_tokens is None:
        args.max_tokens = 16 if args.tiny else 1024
    import torch

    if args.train_compile is None:
        args.train_compile = torch.cuda.is_available() and not args.tiny
    if args.warmup < 1 or args.steps <= args.warmup:
        parser.error("need 1 <= --warmup < --steps")
    if missing := missing_modules(args.runs):
        parser.error(f"--runs {args.runs} needs {' and '.join(missing)}, not installed here: pip install "
                     "'opd[eval]' (math_verify) or 'opd[gpu]' (vllm); on the device machine carry "
                     "benchmarks/gpu/pack-wheels.sh's parts, which hold both")
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="opd-bench-loop-"))
    tmp.mkdir(parents=True, exist_ok=True)
    model = build_models(tmp, args.tiny)
    bw = copy_bandwidth()
    figures = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bw,
               "machine": {"host": host(), "gpu": gpu()},
               "settings": {k: v for k, v in vars(args).items() if k not in ("json", "keep")}, "results": []}
    for spec in args.runs.split(","):
        figures["results"].append(run_one(spec, model, tmp, args, bw))
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    print(table(figures["results"]))
    print(json.dumps(figures), file=sys.stderr)
    return 1 if any("error" in r for r in figures["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
