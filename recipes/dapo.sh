#!/usr/bin/env bash
# DAPO (controlled variant): RL with a verifiable reward. Each prompt gets a group of samples; the
# verifier grades each response's integer answer (only when it stopped on its own), group-normalized
# advantages drive a PPO surrogate with clip-higher, groups that are all right or all wrong are
# dropped (dynamic sampling), overlong responses get the soft penalty, plus a k3 KL 0.01 to the base.
#
#   recipes/dapo.sh --model Qwen/Qwen3-4B-Instruct-2507 --out runs/dapo [--steps 128 --groups 64 ...]
#
# Pipeline:
#   opd-rollout --follow OUT --max-lag 0 --batch-prompts F*G
#     | opd-score --reward math --grader integer --require-stop --reward-scale pm1 --max-response-tokens L --overlong-buffer B
#     | opd-train --loss dapo --kl-coef 0.01 --batch-groups G --max-staleness 0   (= --max-lag)
#
# Seed hyper-parameters (docs/architecture.md, seeds) this recipe (flag, default)
#   Qwen3-4B-Instruct-2507 + LoRA r16 / alpha 32       --model Qwen/Qwen3-4B-Instruct-2507, --lora-r 16, --lora-alpha 32
#   non-thinking, context 8192                         --thinking off, --max-model-len 8192 (vllm),
#                                                      --max-tokens 7168 (response; leaves 1024 for the prompt)
#   verifier reward: integer answer, finish = stop     --reward math --grader integer --require-stop
#   correctness reward 2 * correct - 1 (+1 / -1)       --reward-scale pm1
#   soft overlong penalty, added to it                 --max-response-tokens = --max-tokens, --overlong-buffer 1024
#   clip-low 0.2 / clip-high 0.28, token-mean          --loss dapo (opd-train defaults --clip-low 0.2 --clip-high 0.28)
#   dynamic sampling                                   on (opd-train default for dapo), --gen-factor 3
#   k3 KL to the base 0.01                             --kl-coef 0.01
#   lr 2e-5, 10 warm-up steps                          --lr 2e-5, --warmup-steps 10
#   128 updates x 64 groups x 8 samples                --steps 128, --groups 64, --group-size 8
#   data: integer-answer math problems                 --data train-aime (bundled AIME 1983-2023, integer answers)
#   sampling T 1.0, top-p 1.0                          opd-rollout defaults
#
# Where this toolkit deviates, and why
#   - Dynamic sampling in an on-policy pipe: DAPO generates 3x the prompts it trains on and keeps
#     generating until the batch has G informative groups. Here each rollout batch has F x G prompts
#     (--gen-factor F, default 3, DAPO's generation batch), sampled with the newest checkpoint; the
#     trainer keeps the first G informative groups, and --max-staleness 0 drops the leftovers at the
#     next step, so every step still trains on the previous step's policy only. When a batch has
#     fewer than G informative groups the trainer says so in OUT/reader.json and the rollout samples
#     another batch with the same checkpoint (the trainer's --max-candidate-batches bounds how many it
#     reads). --gen-factor only sets how much is sampled at once.
#   - A tiny random model answers nothing right, so every group is all-wrong and dynamic sampling
#     would drop them all: the tests pass --extra-train --no-dynamic-sampling (all advantages are 0,
#     only the k3 term moves the adapter) and --gen-factor 1.
#   - The dual clip (c = 10 for negative advantages, opd-train's default) is kept; the seed's 8192
#     context is split as 7168 response + 1024 prompt tokens, with the overlong buffer 1024 (DAPO used
#     4096 of 20480; the same fifth, rounded).
#   - --max-lag 0 (default), as the seed: each step samples with the previous step's policy, and
#     --max-staleness 0 keeps it so (the trainer's --max-staleness follows --max-lag). --max-lag 1
#     overlaps sampling and training (dapo's clipped ratio corrects for the lag): bench_loop_gpu.py's
#     DAPO-shaped loop (16 x 8 x 1,024 tokens, grpo, random weights) made 11,704, 9,864 and 8,967
#     completion tokens/s at lag 1 on three H100s and 12,416 on one H200 (docs/benchmarks.md); lag 0
#     and the drift a learning policy gives at lag 1 are not measured on a GPU.
#
# First: opd-check with the recipe's flags on 2 prompts (report on stderr; --no-check skips it).
# Other flags: --out DIR (required), --engine auto|vllm|hf, --extra-rollout/--extra-score/--extra-train
# "FLAGS", --bin DIR. stdout: only what opd-train prints (nothing unless --extra-train --metrics-stdout).
set -euo pipefail

MODEL=Qwen/Qwen3-4B-Instruct-2507; DATA=train-aime; STEPS=128; NGROUPS=64; GROUP_SIZE=8; MAX_LAG=0; MAX_TOKENS=7168
OVERLONG_BUFFER=1024; GEN_FACTOR=3; ENGINE=auto; LR=2e-5; LORA_R=16; LORA_ALPHA=32; OUT=; TEACHER=; POST=; PRE=
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
opd_parse "$@"
[[ "$OVERLONG_BUFFER" =~ ^[0-9]+$ ]] && [ "$OVERLONG_BUFFER" -lt "$MAX_TOKENS" ] \
    || { echo "Error: --overlong-buffer must be an integer below --max-tokens ($MAX_TOKENS), got '$OVERLONG_BUFFER'" >&2; exit 2; }
opd_words XR "$EXTRA_ROLLOUT"; opd_words XS "$EXTRA_SCORE"; opd_words XT "$EXTRA_TRAIN"
MODEL_LEN=$(( MAX_TOKENS + 1024 > 8192 ? MAX_TOKENS + 1024 : 8192 ))
opd_check_first --max-model-len "$MODEL_LEN" --temperature 1.0 --thinking off --grader integer --loss dapo --kl-coef 0.01

"${BIN}opd-rollout" --model "$MODEL" --engine "$ENGINE" --follow "$OUT" --max-lag "$MAX_LAG" \
    --batch-prompts $(( GEN_FACTOR * NGROUPS )) -n "$GROUP_SIZE" --max-tokens "$MAX_TOKENS" \
    --max-model-len "$MODEL_LEN" --temperature 1.0 --thinking off --quiet "${XR[@]}" "$DATA" \
  | "${BIN}opd-score" --reward math --grader integer --require-stop --reward-scale pm1 \
    --max-response-tokens "$MAX_TOKENS" --overlong-buffer "$OVERLONG_BUFFER" --quiet "${XS[@]}" \
  | "${BIN}opd-train" --model "$MODEL" --out "$OUT" --max-steps "$STEPS" --batch-groups "$NGROUPS" --save-every "$SAVE_EVERY" --share-policy \
    --loss dapo --clip-low 0.2 --clip-high 0.28 --kl-coef 0.01 --max-staleness "$MAX_LAG" \
    --lora-r "$LORA_R" --lora-alpha "$LORA_ALPHA" --lr "$LR" --warmup-steps 10 --quiet "${XT[@]}"
