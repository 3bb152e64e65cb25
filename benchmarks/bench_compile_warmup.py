"""How long `opd-train --compile` takes to warm up: the layers compiled one by one (opd's compile_decoder) against
the whole decoder compiled as one graph, on the OPSD step (--self-teacher: a forward with gradients and one
without), with record lengths that vary from step to step as a loop's do.

The model is Qwen3's architecture with --layers layers (28 is Qwen3-1.7B's) and tiny widths, random weights: the
compiler's work grows with the graph (layers), not with the widths, so the warm-up compares across modes as it
would at full size, while the step times are the tiny model's. Each mode runs in a fresh process (no compiled
graphs shared); the inductor cache is a fresh folder per run, so nothing is read from an earlier one.

    python benchmarks/bench_compile_warmup.py --layers 28 --steps 6 --json docs/figures/compile_warmup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one(mode: str, layers: int, steps: int, device: str) -> dict:
    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opd_train import model as student_model
    from opd_train.config import TrainConfig
    from opd_train.data import Example
    from opd_train.trainer import Trainer

    if mode == "whole":
        student_model.compile_decoder = torch.compile
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    with torch.device(device):
        lm = Qwen3ForCausalLM(config)
    rng = np.random.default_rng(0)

    def example(i: int) -> Example:
        prompt, teacher, response = int(rng.integers(4, 12)), int(rng.integers(12, 30)), int(rng.integers(20, 250))
        return Example(id=str(i), prompt_id=str(i), prompt_ids=rng.integers(0, 4096, prompt),
                       response_ids=rng.integers(0, 4096, response), teacher_context=rng.integers(0, 4096, teacher),
                       tokens={"behaviour_logp": np.full(response, -2.0, np.float32)})

    cfg = TrainConfig(model="(random)", out="(none)", loss="fkl", self_teacher="opsd", loss_temperature=1.1,
                      max_steps=10**6, batch_size=4, micro_batch_tokens=600, lora_r=8, lora_alpha=16, compile=True)
    trainer = Trainer(cfg, device=device, lm=lm)
    rows = []
    for _ in range(steps):
        examples = [example(i) for i in range(4)]
        start = time.perf_counter()
        metrics = trainer.train_step(examples)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        rows.append({"seconds": round(time.perf_counter() - start, 3), "loss": metrics["loss"]})
    return {"mode": mode, "layers": layers, "steps": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--modes", default="regional,whole")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one mode in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.layers, args.steps, args.device)))
        return 0
    runs = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--layers", str(args.layers),
                                  "--steps", str(args.steps), "--device", args.device],
                                 env=env, check=True, capture_output=True, text=True).stdout
        run = json.loads(out.strip().splitlines()[-1])
        seconds = [row["seconds"] for row in run["steps"]]
        run["warmup_seconds"] = round(sum(seconds[:2]), 1)  # steps 1-2: the first shapes, then symbolic ones
        run["later_step_seconds"] = round(sum(seconds[2:]) / max(len(seconds) - 2, 1), 3)
        runs.append(run)
        print(f"{mode:9s} {args.layers} layers: steps 1-2 {run['warmup_seconds']} s, later steps "
              f"{run['later_step_seconds']} s each; losses {[row['loss'] for row in run['steps']]}", file=sys.stderr)
    figures = {"device": args.device, "layers": args.layers, "steps": args.steps, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
