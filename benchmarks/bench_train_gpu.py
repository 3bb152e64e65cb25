"""opd-train's step on a Qwen3-1.7B-shaped model (random weights): tokens/s, MFU, peak memory.

The trainer's own code (`opd_train.trainer.Trainer.train_step` with `opd_train.model.Student`): LoRA r64
(alpha 128) on all seven projections, records of --prompt-len + 1024 response tokens with top-16
teacher ids and log-probs, `--loss fkl` (top-16 with the tail bucket, clip 0.05), AdamW, one
optimizer step per --records records, at several --micro-batch-tokens sizes, eager and compiled.
`--objective opsd` runs the OPSD recipe's step instead: `--loss fkl --self-teacher` (the base weights with
the adapter off forward the privileged prompt, --teacher-len tokens, then the full-vocabulary KL, clip 0.05,
temperature 1.1); prompt and teacher lengths vary per record (0.5x-1.5x, as the MATH prompts' do).

tokens/s counts response tokens. MFU = 4 x parameters x tokens/s / 989e12: 2N for the forward and
2N for the backward of a frozen base (activation gradients only; LoRA's own FLOPs and the prompt
tokens are not counted). With --gradient-checkpointing the recomputed forward (another 2N) is
not counted either, so that row's MFU is what the user gets, not what the GPU does.

    python benchmarks/bench_train_gpu.py --json docs/figures/train_gpu.json
    python benchmarks/bench_train_gpu.py --tiny       # CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import json
import sys
import time

H200_BF16_FLOPS = 989e12


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=32, help="records per optimizer step")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--objective", choices=("fkl", "opsd"), default="fkl",
                        help="fkl: top-16 teacher data; opsd: --self-teacher (full-vocabulary KL)")
    parser.add_argument("--teacher-len", type=int, default=424,
                        help="opsd: mean privileged-prompt tokens (the bundled MATH train's opsd template: 423)")
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--micro", default="4,8,16", help="micro-batch sizes in records")
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up step)")
    parser.add_argument("--variants", default="eager,compile,compile+ckpt")
    parser.add_argument("--logit-chunk", type=int, default=4096, help="positions per LM-head chunk")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--profile", help="write a torch.profiler table of one more step (top kernels) to this file")
    args = parser.parse_args()

    import numpy as np
    import torch
    from transformers import Qwen3ForCausalLM

    sys.path.insert(0, "benchmarks")
    from bench_score_gpu import model_config

    from opd_train.config import TrainConfig
    from opd_train.data import Example
    from opd_train.trainer import Trainer

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.tiny:
        args.records, args.prompt_len, args.response_len, args.micro, args.steps = 4, 8, 32, "2,4", 1
        args.teacher_len = 16
    config = model_config(args.tiny)
    V = config.vocab_size
    rng = np.random.default_rng(0)

    def example(i: int) -> Example:
        if args.objective == "opsd":
            P = int(rng.integers(args.prompt_len // 2, args.prompt_len * 3 // 2 + 1))
            PT = int(rng.integers(args.teacher_len // 2, args.teacher_len * 3 // 2 + 1))
            return Example(id=str(i), prompt_id=str(i), prompt_ids=rng.integers(0, V, P),
                           response_ids=rng.integers(0, V, args.response_len), teacher_context=rng.integers(0, V, PT),
                           tokens={"behaviour_logp": np.full(args.response_len, -2.0, np.float32)})
        logits = rng.standard_normal((args.response_len, 16)).astype(np.float32)
        logp = logits - np.log(np.exp(logits).sum(1, keepdims=True)) - 0.5  # 16 ids holding ~60% of the mass
        return Example(id=str(i), prompt_id=str(i), prompt_ids=rng.integers(0, V, args.prompt_len),
                       response_ids=rng.integers(0, V, args.response_len),
                       tokens={"ids": rng.integers(0, V, (args.response_len, 16)),
                               "teacher_logp": logp.astype(np.float32)})

    examples = [example(i) for i in range(args.records)]
    tokens = args.records * args.response_len
    figures = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "records_per_step": args.records, "prompt_len": args.prompt_len, "response_len": args.response_len,
               "lora_r": 64, "objective": args.objective,
               "loss": ("fkl top-16 + tail, clip 0.05" if args.objective == "fkl" else
                        f"fkl --self-teacher: full vocabulary, clip 0.05, T 1.1, teacher prompts ~{args.teacher_len}"),
               "mfu": "4 x parameters x response tokens/s / 989e12 (2N forward + 2N backward; LoRA FLOPs, prompt "
                      "tokens and the recomputed forward of gradient checkpointing not counted)", "runs": []}
    for variant in args.variants.split(","):
        for micro in [int(m) for m in args.micro.split(",")]:
            torch.manual_seed(0)
            with torch.device(device):
                lm = Qwen3ForCausalLM(config).to(dtype)
            params = sum(p.numel() for p in lm.parameters())
            opsd = dict(self_teacher="opsd", loss_temperature=1.1) if args.objective == "opsd" else {}
            cfg = TrainConfig(model="(random)", out="(none)", loss="fkl", max_steps=10**6, batch_size=args.records,
                              **opsd,
                              micro_batch_tokens=micro * (args.prompt_len + args.response_len),
                              logit_chunk=args.logit_chunk,
                              lora_r=64, lora_alpha=128, lr=1e-5, compile="compile" in variant,
                              gradient_checkpointing="ckpt" in variant)
            trainer = Trainer(cfg, device=device, lm=lm)
            # opsd: the self-teacher's forward (2N a token of its prompt and the response) counted too
            flops = sum(4 * params * len(ex.response_ids)
                        + 2 * params * (len(ex.teacher_context) + len(ex.response_ids))
                        for ex in examples) if opsd else 0
            row = {"variant": variant, "micro_batch_records": micro, "logit_chunk": args.logit_chunk,
                   "parameters": params}
            try:
                t_warm = time.perf_counter()
                trainer.train_step(examples)  # warm-up (and compilation)
                row["warmup_seconds"] = round(time.perf_counter() - t_warm, 1)
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    m = trainer.train_step(examples)
                if device == "cuda":
                    torch.cuda.synchronize()
                seconds = (time.perf_counter() - t0) / args.steps
                tps = tokens / seconds
                row.update(step_seconds=round(seconds, 3), response_tokens_per_s=round(tps),
                           mfu=round(4 * params * tps / H200_BF16_FLOPS, 4), loss=m["loss"],
                           **({"mfu_with_teacher": round(flops / seconds / H200_BF16_FLOPS, 4)} if opsd else {}),
                           peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None)
                if args.profile:
                    from torch.profiler import ProfilerActivity, profile

                    phases = label_phases(trainer.student)
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if device == "cuda"
                                 else [ProfilerActivity.CPU]) as prof:
                        trainer.train_step(examples)
                        if device == "cuda":
                            torch.cuda.synchronize()
                    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
                    with open(args.profile, "a") as f:
                        f.write(f"== {variant} micro {micro}\n")
                        f.write(prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=70) + "\n")
                        f.write(phase_table(prof, phases) + "\n")
            except torch.OutOfMemoryError as exc:
                row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
            figures["runs"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(figures, f, indent=1)
            del trainer, lm
            if device == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()
    return 0


def label_phases(student) -> list[str]:
    """Wrap the student's decoder forward (teacher / student by grad mode) and chunk loss in profiler ranges."""
    import torch

    def wrap(fn, name_of):
        def labelled(*args, **kwargs):
            with torch.profiler.record_function(name_of()):
                return fn(*args, **kwargs)
        return labelled

    student.hidden = wrap(student.hidden, lambda: "phase: student forward" if torch.is_grad_enabled()
                          else "phase: teacher/reference forward (no grad)")
    student.chunk_loss = wrap(student.chunk_loss, lambda: "phase: chunk LM head + loss (forward)")
    return ["phase: student forward", "phase: teacher/reference forward (no grad)",
            "phase: chunk LM head + loss (forward)"]


def phase_table(prof, phases: list[str]) -> str:
    """Device time inside each labelled range (the rest of the step: backward, optimizer)."""
    rows = []
    for event in prof.key_averages():
        if event.key in phases:
            device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
            rows.append(f"{event.key:45s} calls {event.count:4d}  cpu {event.cpu_time_total / 1e3:9.1f} ms  "
                        f"device {device_us / 1e3:9.1f} ms")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
