#!/usr/bin/env bash
# On the GPU machine, after the parts of pack-wheels.sh are installed into /tmp/site:
#   bash benchmarks/gpu/loop-bench.sh start [bench_loop_gpu.py flags]   # install opd, run the benchmark detached
#   bash benchmarks/gpu/loop-bench.sh wait SECONDS                      # wait (up to SECONDS), copy results to $OUT
# The benchmark outlives one device call (setsid); every `wait` copies its JSON and the tail of its log.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
mkdir -p /tmp/bench
case "${1:-}" in
  start)
    shift
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
    command -v opd-rollout >/dev/null || { echo "opd-rollout not on PATH after pip install -e ."; exit 1; }
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    setsid nohup python3 benchmarks/bench_loop_gpu.py --json /tmp/bench/loop_gpu.json --keep /tmp/bench/work "$@" \
        > /tmp/bench/log.txt 2>&1 < /dev/null &
    echo "started: pid $!" ;;
  wait)
    end=$(( $(date +%s) + ${2:-500} ))
    # the JSON is copied as it grows (rewritten after every run): a call cut short still brings back the runs done
    while [ "$(date +%s)" -lt "$end" ] && pgrep -f bench_loop_gpu.py >/dev/null; do
      cp /tmp/bench/loop_gpu.json "$OUT/" 2>/dev/null; sleep 5; done
    pgrep -f bench_loop_gpu.py >/dev/null && echo "still running" || echo "finished"
    cp /tmp/bench/loop_gpu.json "$OUT/" 2>/dev/null
    tail -c 200000 /tmp/bench/log.txt > "$OUT/log.txt"
    (cd /tmp/bench/work 2>/dev/null && tar czf "$OUT/timelines.tgz" timeline-* run-*/metrics.jsonl gpu-*.csv 2>/dev/null)
    for f in /tmp/bench/work/log-*.txt; do [ -f "$f" ] && tail -c 100000 "$f" > "$OUT/$(basename "$f")"; done
    grep -v '^{' /tmp/bench/log.txt | grep -v "^\[.*\] /" | tail -25 ;;
  *) echo "usage: $0 start|wait" >&2; exit 2 ;;
esac
