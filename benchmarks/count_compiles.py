"""How many graphs `opd-train --compile` builds over OPSD-shaped micro-steps of varying shapes (CPU or GPU).

    python benchmarks/count_compiles.py MODEL_DIR [--steps 6] [--device cpu]

Each step draws 8 records (prompt 10-40, response 5-60 and teacher prompt 30-120 tokens), micro-batches
them as the trainer does and runs the student's forward + backward with the base-weights teacher pass
(fkl with --self-teacher). Prints, per step, the micro-batch sizes, dynamo's frames and unique graphs so
far, the recompile-limit hits and the step's seconds; the last line is JSON. A step that compiles nothing
new leaves `unique_graphs` where it was. MODEL_DIR: any causal LM folder (e.g. the demo world's base
model, `python -m opd_common.demo DIR` writes DIR/base).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from torch._dynamo.utils import counters

from opd_train.config import TrainConfig
from opd_train.data import Example, micro_batches
from opd_train.model import Student


def records(rng, vocab: int, n: int = 8) -> list[Example]:
    out = []
    for i in range(n):
        p, t = int(rng.integers(10, 40)), int(rng.integers(5, 60))
        out.append(Example(id=str(i), prompt_id=str(i), prompt_ids=rng.integers(0, vocab, p),
                           response_ids=rng.integers(0, vocab, t),
                           tokens={"behaviour_logp": -rng.random(t).astype(np.float32)},
                           teacher_context=rng.integers(0, vocab, p + int(rng.integers(20, 80)))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = TrainConfig(model=args.model, out="unused", loss="fkl", self_teacher="{problem}", max_steps=1,
                         lora_r=4, lora_alpha=8, batch_size=8, compile=True, micro_batch_tokens=600, logit_chunk=64)
    student = Student(config, args.device)
    vocab = min(student.head.weight.shape[0], 1000)
    rng = np.random.default_rng(0)
    rows = []
    for step in range(args.steps):
        exs = records(rng, vocab)
        mbs = micro_batches(exs, config.micro_batch_tokens)
        start = time.perf_counter()
        for mb in mbs:
            student.micro_step(mb, sum(len(e.response_ids) for e in exs), 0.0)
        row = {"step": step, "micro_batches": [len(m) for m in mbs], "frames": counters["frames"]["ok"],
               "unique_graphs": counters["stats"]["unique_graphs"],
               "graph_breaks": sum(counters["graph_break"].values()),
               "seconds": round(time.perf_counter() - start, 2)}
        rows.append(row)
        print(row, flush=True)
    print(json.dumps({"steps": rows, "unique_graphs": rows[-1]["unique_graphs"],
                      "graph_breaks": rows[-1]["graph_breaks"]}))


if __name__ == "__main__":
    main()
