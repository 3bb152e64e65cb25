"""Wall-clock of the on-policy loop with --max-lag 0 (strict) vs 1 (sampling overlaps training).

opd-rollout --follow RUN --max-lag L | opd-score --teacher | opd-train --save-every 1, on the tiny
models (transformers engine), the same budget for both; each setting is run --repeats times and the
median wall-clock is reported.

    python benchmarks/bench_loop.py --threads 1 --steps 10 --repeats 3 --json docs/figures/loop_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=4, help="prompts per step (--batch-prompts = --batch-groups)")
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0,
                        help="OMP_NUM_THREADS for every stage (0 = torch's default: all cores per process)")
    parser.add_argument("--json")
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, seed in (("student", 0), ("teacher", 1)):
            subprocess.run([sys.executable, "-m", "opd_common.tiny", str(tmp / name), "--seed", str(seed)],
                           check=True, capture_output=True)
        results = {}
        for lag in (0, 1):
            times = []
            for r in range(args.repeats):
                run_dir = tmp / f"run-{lag}-{r}"
                command = (
                    f"{bin_dir}/opd-rollout --model {tmp}/student --engine hf --follow {run_dir} --max-lag {lag} "
                    f"--batch-prompts {args.groups} -n {args.n} --max-tokens {args.max_tokens} --quiet train-math | "
                    f"{bin_dir}/opd-score --teacher t={tmp}/teacher --quiet | "
                    f"{bin_dir}/opd-train --model {tmp}/student --loss rkl --out {run_dir} --max-steps {args.steps} "
                    f"--batch-groups {args.groups} --save-every 1 --quiet")
                t0 = time.perf_counter()
                subprocess.run(["bash", "-o", "pipefail", "-c", command], check=True, env=env)
                times.append(time.perf_counter() - t0)
            results[f"max_lag_{lag}"] = {"seconds": [round(t, 2) for t in times],
                                         "median_s": round(statistics.median(times), 2)}
            print(f"--max-lag {lag}: median {statistics.median(times):.1f} s over {times}", file=sys.stderr)
    figures = {"threads_per_stage": args.threads or "default", "steps": args.steps, "groups": args.groups, "n": args.n,
               "max_tokens": args.max_tokens,
               "engine": "hf (CPU)", **results,
               "speedup": round(results["max_lag_0"]["median_s"] / results["max_lag_1"]["median_s"], 3)}
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
