"""Record I/O speed: encode + zstd (write) and unzstd + decode + validate (read), per encoding.

    python benchmarks/bench_io.py                      # table on stderr-free stdout
    python benchmarks/bench_io.py --json io.json       # also write the figures as JSON

Records are scored-size: T response tokens with the behaviour policy's top-k ids and log-probs,
one teacher block with log-probs [T], a ~200-token prompt, an example row and a reward. The
work is single-threaded Python (orjson, numpy, zstandard at level 3 with no worker threads), so
tokens/s is per core. Each figure is the best of --repeats passes over --records records.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np
import zstandard

from opd_common.records import SCHEMA, validate
from opd_common.streams import ENCODINGS, decode_line, encode

TARGET_TOKENS_PER_S = 250_000
VOCAB = 151_936  # Qwen3's vocabulary: realistic id magnitudes

PROBLEM = ("Let $N$ be the number of ordered pairs of positive integers $(a, b)$ such that "
           "$a + b = 1000$ and neither $a$ nor $b$ has a zero digit. Find the remainder when $N$ is "
           "divided by $1000$.")
SOLUTION = ("We count the pairs by the units, tens and hundreds digits in turn, carrying where "
            "needed. " * 18).strip()


WORDS = sorted(set((PROBLEM + " " + SOLUTION).split()))


def make_record(i: int, T: int, k: int, prompt_len: int, rng: np.random.Generator) -> dict:
    """One scored record with random (but realistically shaped and valued) per-token arrays."""
    logprobs_T = -rng.exponential(0.7, T).astype(np.float32)
    topk_logprobs_TK = np.sort(-rng.exponential(2.0, (T, k)).astype(np.float32), axis=1)[:, ::-1]
    return {
        "schema": SCHEMA,
        "id": f"aime24-{i // 8}:{i % 8}",
        "prompt_id": f"aime24-{i // 8}",
        "sample": i % 8,
        "group_size": 8,
        "example": {"id": f"aime24-{i // 8}", "problem": PROBLEM, "solution": SOLUTION, "answer": "229",
                    "source": "aime24"},
        "policy": {"model": "Qwen/Qwen3-1.7B", "revision": "main", "adapter": None, "version": 0},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": T, "seed": 1000 + i,
                     "engine": "vllm", "logprobs": "raw", "thinking": True},
        "prompt_ids": rng.integers(0, VOCAB, prompt_len).tolist(),
        "response_ids": rng.integers(0, VOCAB, T, dtype=np.int32),
        "finish_reason": "length",
        "response_text": " ".join(rng.choice(WORDS, T)),  # one word per token, for people
        "logprobs": logprobs_T,
        "topk_ids": rng.integers(0, VOCAB, (T, k), dtype=np.int32),
        "topk_logprobs": np.ascontiguousarray(topk_logprobs_TK),
        "teachers": {"teacher": {"model": "Qwen/Qwen3-8B", "revision": "main", "adapter": None,
                                 "prompt": "as-is", "logprobs": -rng.exponential(0.9, T).astype(np.float32)}},
        "reward": {"correct": False, "format_ok": True, "length_penalty": 0.0, "total": 0.0,
                   "verifier": "math-verify"},
    }


def write_pass(recs: list[dict], encoding: str, level: int) -> bytes:
    """encode + zstd (level 3 is what ShardWriter and --compress use); returns the compressed bytes."""
    cctx = zstandard.ZstdCompressor(level=level)
    chunks = []
    comp = cctx.compressobj()
    for rec in recs:
        chunks.append(comp.compress(encode(rec, encoding)))
    chunks.append(comp.flush())
    return b"".join(chunks)


def read_pass(blob: bytes) -> int:
    """unzstd + decode_line + validate, as iter_inputs does; returns the number of records."""
    data = zstandard.ZstdDecompressor().decompressobj().decompress(blob)
    n = 0
    for n, line in enumerate(data.splitlines(), start=1):  # noqa: B007 (n is returned after the loop)
        validate(decode_line(line, "bench"), "bench")
    return n


def best_of(repeats: int, fn, *args) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(records: int, tokens: int, k: int, prompt_len: int, repeats: int, level: int = 3) -> list[dict]:
    rng = np.random.default_rng(0)
    recs = [make_record(i, tokens, k, prompt_len, rng) for i in range(records)]
    total_tokens = records * tokens
    rows = []
    for encoding in ENCODINGS:
        raw_bytes = sum(len(encode(rec, encoding)) for rec in recs)
        write_s, blob = best_of(repeats, write_pass, recs, encoding, level)
        read_s, n = best_of(repeats, read_pass, blob)
        assert n == records
        rows.append({
            "encoding": encoding,
            "write_tokens_per_s": total_tokens / write_s,
            "read_tokens_per_s": total_tokens / read_s,
            "raw_bytes_per_record": raw_bytes / records,
            "zstd_bytes_per_record": len(blob) / records,
            "write_s": write_s,
            "read_s": read_s,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=50, help="records per pass [50]")
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens per record (T) [1024]")
    parser.add_argument("--topk", type=int, default=16, help="top-k ids and log-probs per token (k) [16]")
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens per record [200]")
    parser.add_argument("--level", type=int, default=3, help="zstd level; the writers use 3 [3]")
    parser.add_argument("--repeats", type=int, default=3, help="passes per figure; the best is kept [3]")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    rows = run(args.records, args.tokens, args.topk, args.prompt, args.repeats, args.level)
    print(f"{args.records} records x T={args.tokens}, k={args.topk}, prompt {args.prompt} ids; "
          f"zstd level {args.level}; best of {args.repeats}; one core; "
          f"target >= {TARGET_TOKENS_PER_S:,} tokens/s each way")
    print(f"{'encoding':<9} {'write tok/s':>12} {'read tok/s':>12} {'raw KB/rec':>11} {'zstd KB/rec':>12}")
    for r in rows:
        print(f"{r['encoding']:<9} {r['write_tokens_per_s']:>12,.0f} {r['read_tokens_per_s']:>12,.0f} "
              f"{r['raw_bytes_per_record'] / 1024:>11.1f} {r['zstd_bytes_per_record'] / 1024:>12.1f}")
    if args.json:
        meta = {"records": args.records, "tokens": args.tokens, "topk": args.topk, "prompt": args.prompt,
                "repeats": args.repeats, "zstd_level": args.level, "target_tokens_per_s": TARGET_TOKENS_PER_S,
                "python": sys.version.split()[0], "machine": platform.machine(),
                "processor": platform.processor() or None, "numpy": np.__version__,
                "zstandard": zstandard.__version__}
        with open(args.json, "w") as f:
            json.dump({"config": meta, "results": rows}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
