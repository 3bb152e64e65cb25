"""opd-score's throughput with a teacher of another tokenizer beside the same-tokenizer figure (issue 20), CPU.

Records: MATH solutions (bundled data) tokenized by the student's tokenizer (the tiny plain BPE), cut to
--response-len tokens + EOS, after a chat-rendered prompt. Teachers, each the same architecture (random
weights, seed 1):

  same    the student's tokenizer: token ids as they are (--align auto)
  text    the student's tokenizer with --align text: the chunk bookkeeping on one-token chunks
  other   the digit-splitting BPE of opd_common.tiny: alignment over text (teachers.NAME.text)

Each mode runs the Scorer opd-score runs (hf engine, float32, CPU) over the same window of records,
interleaved over --repeats rounds so that a busy machine slows every mode alike; the figure is the
median of the rounds, in student response tokens per second (what a user gets scored). The alignment
alone (opd_common.xtok.Aligner over the window) is timed too. --size demo uses the demo world's model
shape (hidden 128, 4 layers), tiny the test models' (hidden 64, 2 layers): the smaller the model, the
larger the alignment's share.

    python benchmarks/bench_score_xtok.py --json docs/figures/score_xtok_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODES = ("same", "text", "other")


def build_models(root: Path, size: str) -> dict[str, Path]:
    from opd_common.demo import MODEL
    from opd_common.tiny import build_model, build_tokenizer

    shape = MODEL if size == "demo" else {}
    out = {}
    for name, split in (("student", False), ("other", True)):
        tok = build_tokenizer(split_digits=split)
        for seed, suffix in ((0, ""), (1, "-teacher")) if name == "student" else ((1, ""),):
            path = root / f"{name}{suffix}"
            build_model(tok, seed=seed, **shape).save_pretrained(path)
            tok.save_pretrained(path)
            out[f"{name}{suffix}"] = path
    return out


def make_records(student: Path, n: int, response_len: int) -> list[dict]:
    from transformers import AutoTokenizer

    from opd_common.datasets import data_path
    from opd_common.models import render_chat
    from opd_common.records import SCHEMA

    tok = AutoTokenizer.from_pretrained(student)
    recs = []
    with open(data_path("train_math_full.jsonl")) as f:
        for i, line in enumerate(f):
            if len(recs) == n:
                break
            row = json.loads(line)
            ids = tok(row["solution"], add_special_tokens=False)["input_ids"][:response_len] + [tok.eos_token_id]
            recs.append({"schema": SCHEMA, "id": f"p{i}:0", "prompt_id": f"p{i}", "sample": 0, "group_size": 1,
                         "example": {"problem": row["problem"]}, "policy": {"model": str(student), "version": 0},
                         "prompt_ids": np.asarray(render_chat(tok, row["problem"], False), np.int32),
                         "response_ids": np.asarray(ids, np.int32), "finish_reason": "stop",
                         "logprobs": np.zeros(len(ids), np.float32)})
    return recs


def scorer_for(teacher: Path, align: str):
    from opd_score.config import ScoreConfig
    from opd_score.scorer import Scorer

    return Scorer(ScoreConfig(teacher=[f"t={teacher}"], align=align, quiet=True, device="cpu"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", choices=("tiny", "demo"), default="demo")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-xtok-"))
    models = build_models(root, args.size)
    recs = make_records(models["student"], args.records, args.response_len)
    tokens = sum(len(r["response_ids"]) for r in recs)
    teachers = {"same": (models["student-teacher"], "auto"), "text": (models["student-teacher"], "text"),
                "other": (models["other"], "auto")}
    scorers = {}
    for mode in MODES:
        scorers[mode] = scorer_for(*teachers[mode])
        scorers[mode].open(recs[0])
    times: dict[str, list[float]] = {m: [] for m in (*MODES, "align")}
    for _ in range(args.repeats):
        for mode in MODES:
            window = [({**r, "teachers": {}}, None) for r in recs]
            t0 = time.perf_counter()
            scorers[mode].score(window)
            times[mode].append(time.perf_counter() - t0)
        aligner = scorers["other"].aligners["t"]
        t0 = time.perf_counter()
        for r in recs:
            aligner(r["response_ids"])
        times["align"].append(time.perf_counter() - t0)
    chunks = [len(w["teachers"]["t"]["text"]["student_end"]) for w, _ in window]
    teacher_tokens = sum(len(w["teachers"]["t"]["text"]["ids"]) for w, _ in window)
    figures = {"records": len(recs), "response_tokens": tokens, "size": args.size, "threads": args.threads,
               "repeats": args.repeats, "other_teacher_tokens": teacher_tokens, "other_chunks": sum(chunks),
               "tokens_per_s": {m: tokens / statistics.median(times[m]) for m in times},
               "seconds": {m: [round(t, 4) for t in times[m]] for m in times}}
    for mode in MODES:
        print(f"{mode:6s} {figures['tokens_per_s'][mode]:10.0f} student tokens/s", file=sys.stderr)
    print(f"align  {figures['tokens_per_s']['align']:10.0f} student tokens/s (alignment alone); {tokens} student "
          f"tokens, {teacher_tokens} teacher tokens, {sum(chunks)} chunks", file=sys.stderr)
    for s in scorers.values():
        s.close()
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
