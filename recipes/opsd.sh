#!/usr/bin/env bash
# OPSD (on-policy self-distillation): the student is its own teacher. The teacher is the same base
# weights with the LoRA adapter off, shown the problem plus its reference solution (the `opsd`
# privileged template, thinking on); the loss is the per-token forward KL teacher -> student over
# the full vocabulary, each summand clipped at 0.05, both sides at temperature 1.1.
#
#   recipes/opsd.sh --model Qwen/Qwen3-1.7B --out runs/opsd [--steps 100 --groups 32 ...]
#
# Pipeline (no opd-score stage: the trainer computes the teacher itself):
#   opd-rollout --follow OUT --max-lag 2 | opd-train --loss fkl --self-teacher opsd --max-staleness 2
#
# Seed hyper-parameters (docs/architecture.md, seeds) this recipe (flag, default)
#   student Qwen3-1.7B + LoRA r64 / alpha 128          --model Qwen/Qwen3-1.7B, --lora-r 64, --lora-alpha 128
#   rollouts non-thinking, T 1.1, top-p 0.95, top-k 20 --thinking off --temperature 1.1 --top-p 0.95 --top-k 20
#   1024 response tokens                               --max-tokens 1024
#   teacher: same base, LoRA off, problem + reference  --self-teacher opsd --self-teacher-thinking on
#     solution + transition prompt, thinking on
#   fkl over the full vocabulary, clip 0.05, T 1.1     --loss fkl --kl-clip 0.05 --loss-temperature 1.1
#   lr 5e-6, grad clip 0.1                             --lr 5e-6, --max-grad-norm 0.1
#   100 steps x 32 prompts x 1 sample                  --steps 100, --groups 32, --group-size 1
#   training data: problems with reference solutions   --data train-math (bundled MATH train, with solutions)
#
# Where this toolkit deviates, and why
#   - The teacher runs inside the trainer (--self-teacher): a second forward of the base weights with
#     the adapter disabled on the privileged prompt, so the KL is over the full vocabulary exactly as
#     in the seed, and no teacher tensors cross the pipe. (An opd-score teacher would only give a
#     top-k approximation; docs/losses.md measures how far that is.)
#   - --max-lag 2 (default): step s trains on responses sampled by the adapter of step s - 1, s - 2 or
#     s - 3, so sampling overlaps training and with vLLM three batches (~96 sequences) decode at once.
#     Measured (docs/benchmarks.md, bench_loop_gpu.py, Qwen3-1.7B shape, random weights): lag 2 7,186
#     completion tokens/s on one H200 (4.53 s a step, ratio 0.9947) and 7,696, 6,543 and 6,835 on three
#     H100s (4.26-5.01 s, ratio 0.9944-0.9945); on the first H100, lag 1 5,993 (5.47 s), ratio 0.9949;
#     on the second, lag 0 3,962, ratio 0.9955 (no lag there: likely the bf16 gap between vLLM and the
#     trainer, seen through this recipe's top-p/top-k sampling). The ratio (mean
#     exp(log p_S - log p_behaviour) at the sampled tokens) is reported, not applied: fkl has none. The lag's
#     gauge is `drift` in metrics.jsonl (k3 of KL(sampler || trainer), docs/losses.md; not yet measured on a
#     GPU): with random weights at lr 5e-6 the policy moves little, so watch it on a real run and lower
#     --max-lag if it grows well above its lag-0 value. --max-lag 0 is strictly on-policy, as the
#     seed samples every step (the earlier strict loop measured 1,905 tokens/s on one H200). Each step's
#     loss is one token mean over the batch.
#   - The optimizer is opd-train's AdamW (constant schedule, no warm-up), weight decay 0.
#   - Each step's adapter reaches the rollout through opd-train --share-policy (OUT/policy/, no
#     optimizer state, no fsync); checkpoints for --resume come every --save-every steps (default 10).
#
# First: opd-check with the recipe's flags on 2 prompts (report on stderr; --no-check skips it).
# Other flags: --out DIR (required), --engine auto|vllm|hf, --extra-rollout/--extra-score/--extra-train
# "FLAGS" (appended to that stage; --extra-score is unused here), --bin DIR (where opd-* live).
# stdout: only what opd-train prints (nothing unless --extra-train --metrics-stdout).
set -euo pipefail

MODEL=Qwen/Qwen3-1.7B; DATA=train-math; STEPS=100; NGROUPS=32; GROUP_SIZE=1; MAX_LAG=2; MAX_TOKENS=1024
ENGINE=auto; LR=5e-6; LORA_R=64; LORA_ALPHA=128; OUT=; TEACHER=; POST=; PRE=
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
opd_parse "$@"
opd_words XR "$EXTRA_ROLLOUT"; opd_words XT "$EXTRA_TRAIN"
opd_check_first --temperature 1.1 --top-p 0.95 --top-k 20 --thinking off --loss fkl --self-teacher opsd \
    --self-teacher-thinking on --kl-clip 0.05 --loss-temperature 1.1

"${BIN}opd-rollout" --model "$MODEL" --engine "$ENGINE" --follow "$OUT" --max-lag "$MAX_LAG" \
    --batch-prompts "$NGROUPS" -n "$GROUP_SIZE" --max-tokens "$MAX_TOKENS" \
    --temperature 1.1 --top-p 0.95 --top-k 20 --thinking off --quiet "${XR[@]}" "$DATA" \
  | "${BIN}opd-train" --model "$MODEL" --out "$OUT" --max-steps "$STEPS" --batch-groups "$NGROUPS" --save-every "$SAVE_EVERY" --share-policy --max-staleness "$MAX_LAG" \
    --loss fkl --self-teacher opsd --self-teacher-thinking on --kl-clip 0.05 --loss-temperature 1.1 \
    --lora-r "$LORA_R" --lora-alpha "$LORA_ALPHA" --lr "$LR" --max-grad-norm 0.1 --quiet "${XT[@]}"
