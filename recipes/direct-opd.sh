#!/usr/bin/env bash
# Direct-OPD: the student follows a teacher's fine-tuning shift. At each response position, at the
# student's own top-16 ids, delta = log pi_post - log pi_pre (a post-trained model minus its
# pre-trained base); the loss is -sum_k w_k delta_k log p_S(k) (w = the student's renormalized
# top-16 probabilities) plus an adaptive k3 KL to the initial student.
#
#   recipes/direct-opd.sh --model Qwen/Qwen2.5-7B-Instruct --post POST_MODEL --pre PRE_MODEL --out runs/dopd
#   recipes/direct-opd.sh ... --data opd_train.parquet     # the seed's training file (verl's layout)
#
# Pipeline (strictly on-policy):
#   opd-rollout --follow OUT --max-lag 0 --topk-logprobs 16 | opd-score --shift post=POST,pre=PRE --shift-k 16
#     | opd-train --loss shift
#
# Seed hyper-parameters (docs/architecture.md, seeds) this recipe (flag, default)
#   student Qwen2.5-7B-Instruct                        --model Qwen/Qwen2.5-7B-Instruct
#   T 1.0, 3328 response tokens                        --temperature 1.0, --max-tokens 3328
#   shift post - pre at the student's top-16           --post, --pre (required), --shift-k 16,
#                                                      rollout --topk-logprobs 16
#   shift loss, adaptive KL (beta 2.5, eps 0.01,       --loss shift (opd-train defaults --beta-init 2.5
#     clamped to [0.5, 2.5])                             --beta-eps 0.01)
#   lr 1e-6                                            --lr 1e-6
#   100 steps x 64 prompts x 4 samples                 --steps 100, --groups 64, --group-size 4
#
# Where this toolkit deviates, and why
#   - The student trains a LoRA adapter (r64 / alpha 128 here), not all weights: opd-train trains LoRA
#     only. lr 1e-6 is the seed's full-parameter rate; LoRA usually wants a larger one (e.g. 1e-5 to
#     1e-4: pass --lr). The k3 reference "initial student" is the base with the adapter off, which is
#     exactly the initial student since LoRA B starts at zero.
#   - The seed's post/pre pair is not fixed here (--post and --pre are required): any two models
#     sharing the student's tokenizer.
#   - Training data: the bundled MATH train set (--data train-math), or the seed's own data as it is:
#     --data opd_train.parquet (verl's layout: the chat `prompt` column is the prompt, system turns kept;
#     reward_model.ground_truth becomes example.answer; extra_info.index the prompt id), or any input
#     opd-rollout reads (a parquet folder, a datasets folder, hf://datasets/ORG/NAME@REV:SPLIT). The chat
#     template is applied once by the rollout (--thinking off: Qwen2.5 has no thinking mode, the flag is
#     ignored by its template).
#   - --max-lag 0 (default), as the seed: the shift loss has no importance correction, so every
#     step trains on the previous step's samples only. Its loop's tokens/s is not measured on a GPU
#     (opd-score's two teachers run on the hf engine); --max-lag 1 overlaps sampling and training as
#     in opsd.sh and opd.sh (docs/benchmarks.md gives what that bought there).
#
# First: opd-check with the recipe's flags on 2 prompts (report on stderr; --no-check skips it).
# Other flags: --out DIR (required), --engine auto|vllm|hf (the rollout; opd-score's shift always
# runs on its exact hf engine), --extra-rollout/--extra-score/--extra-train "FLAGS", --bin DIR.
# stdout: only what opd-train prints (nothing unless --extra-train --metrics-stdout).
set -euo pipefail

MODEL=Qwen/Qwen2.5-7B-Instruct; POST=; PRE=; DATA=train-math; STEPS=100; NGROUPS=64; GROUP_SIZE=4
MAX_LAG=0; MAX_TOKENS=3328; ENGINE=auto; LR=1e-6; LORA_R=64; LORA_ALPHA=128; OUT=; TEACHER=
. "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
opd_parse "$@"
: "${POST:?--post MODEL is required}"; : "${PRE:?--pre MODEL is required}"
opd_words XR "$EXTRA_ROLLOUT"; opd_words XS "$EXTRA_SCORE"; opd_words XT "$EXTRA_TRAIN"
opd_check_first --temperature 1.0 --thinking off --shift "post=$POST,pre=$PRE" --shift-k 16 --loss shift

"${BIN}opd-rollout" --model "$MODEL" --engine "$ENGINE" --follow "$OUT" --max-lag "$MAX_LAG" \
    --batch-prompts "$NGROUPS" -n "$GROUP_SIZE" --max-tokens "$MAX_TOKENS" --temperature 1.0 \
    --thinking off --topk-logprobs 16 --quiet "${XR[@]}" "$DATA" \
  | "${BIN}opd-score" --shift "post=$POST,pre=$PRE" --shift-k 16 --quiet "${XS[@]}" \
  | "${BIN}opd-train" --model "$MODEL" --out "$OUT" --max-steps "$STEPS" --batch-groups "$NGROUPS" --save-every "$SAVE_EVERY" --share-policy \
    --loss shift --beta-init 2.5 --beta-eps 0.01 \
    --lora-r "$LORA_R" --lora-alpha "$LORA_ALPHA" --lr "$LR" --quiet "${XT[@]}"
