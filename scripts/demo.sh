#!/usr/bin/env bash
# The main job on its embedded default: a real vLLM rollout of a tiny model (built offline)
# over the bundled AIME 2024 prompts, printed as records and summarized.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" TOKENIZERS_PARALLELISM=false
out=out/demo
mkdir -p "$out"
[ -f "$out/tiny/config.json" ] || python -m opd_common.tiny "$out/tiny" --seed 0
opd-rollout --model "$out/tiny" --engine vllm -n 4 --temperature 1.0 --max-tokens 64 \
  --topk-logprobs 4 aime24 --out "$out/rollouts" --overwrite
echo "== first two records (opd-cat --decode) ==" >&2
opd-cat "$out/rollouts" --head 2 --decode --fields id,finish_reason,response_text,logprobs
echo "== summary (opd-cat --summary) ==" >&2
opd-cat "$out/rollouts" --summary
