#!/usr/bin/env bash
# The main job (`make demo`): on-policy distillation that visibly works, on a 2-core CPU in minutes.
#
#   1. A demo world (python -m opd_common.demo): 2-digit addition problems with \boxed{} answers
#      (4,000 to train on, 200 held out), a random tiny Qwen3 whose tokenizer splits digits.
#   2. A teacher and a weaker student, both from one `opd-train --loss sft` run on the gold solutions:
#      the teacher is its last checkpoint, the student an early one (merged into plain model folders).
#   3. The preflight (opd-check with the pipeline's flags: report in OUT/check.txt, a FAIL stops the demo),
#      then on-policy distillation through the real pipeline, strictly on-policy (--max-lag 0: every step
#      trains on samples of the previous step's adapter):
#        opd-rollout --follow RUN | opd-score --teacher t=TEACHER --topk 16 | opd-train --loss fkl --out RUN
#      Forward KL on the teacher's top-16 with the tail bucket, without OPSD's per-summand clip
#      (--kl-clip 0): with the clip at 0.05 this student learned next to nothing (its summands are
#      large); rkl at lr 2e-3 diverged. lr 1e-3; --save-every 1 is what lets --max-lag 0 advance.
#   4. opd-eval of the student before (step 0) and after distillation on the held-out problems,
#      opd-eval compare (accuracy gain, paired 95% CI, p-value), opd-eval report (Markdown + plot).
#
# Output in $OPD_DEMO_OUT (default out/demo); the last line printed is the comparison. Sizes can be
# changed through the environment (DEMO_SFT_STEPS, DEMO_STUDENT_STEP, DEMO_DISTILL_STEPS, DEMO_EVAL_N).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" TOKENIZERS_PARALLELISM=false
out=${OPD_DEMO_OUT:-out/demo}
sft_steps=${DEMO_SFT_STEPS:-600}
student_step=${DEMO_STUDENT_STEP:-250}
distill_steps=${DEMO_DISTILL_STEPS:-100}
eval_n=${DEMO_EVAL_N:-4}
world=$out/world
say() { echo "== $(date +%T) $*" >&2; }

say "1/4 demo world -> $world"
python -m opd_common.demo "$world"

say "2/4 teacher and student: opd-train --loss sft, $sft_steps steps (student = step $student_step)"
# Up to 20 passes over the 4,000 gold solutions; the trainer stops after exactly --max-steps steps
# (a process substitution, so the feeder's SIGPIPE when the trainer is done is not the job's status).
opd-train --model "$world/base" --loss sft --out "$out/sft" --overwrite --max-steps "$sft_steps" \
  --batch-size 64 --lora-r 32 --lora-alpha 64 --lora-targets all-linear --lr 3e-3 \
  --lr-schedule cosine --warmup-steps 20 --save-every "$student_step" --quiet \
  < <(for _ in $(seq 20); do cat "$world/sft.jsonl"; done)
python -m opd_common.demo merge "$world/base" "$out/sft/$(cat "$out/sft/latest")" "$out/teacher"
python -m opd_common.demo merge "$world/base" "$(printf '%s/sft/checkpoint-%06d' "$out" "$student_step")" "$out/student"

say "3/4 on-policy distillation: opd-check first, then opd-rollout --follow | opd-score | opd-train, $distill_steps steps"
opd-check --model "$out/student" --engine hf --template '{problem}' --thinking off -n 4 --temperature 1.0 \
    --max-tokens 12 --teacher "t=$out/teacher" --topk 16 --loss fkl --kl-clip 0 --grader integer --limit 4 --quiet \
    "$world/train.jsonl" | tee "$out/check.txt" >&2
rm -rf "$out/distill"
opd-rollout --model "$out/student" --engine hf --template '{problem}' --thinking off -n 4 \
    --temperature 1.0 --max-tokens 12 --batch-prompts 16 --follow "$out/distill" --max-lag 0 --quiet \
    "$world/train.jsonl" |
  opd-score --teacher "t=$out/teacher" --topk 16 --quiet |
  opd-train --model "$out/student" --loss fkl --kl-clip 0 --out "$out/distill" --max-steps "$distill_steps" \
    --batch-groups 16 --lora-r 32 --lora-alpha 64 --lora-targets all-linear --lr 1e-3 --save-every 1 --quiet

say "4/4 evaluation of the student on the 200 held-out problems (avg@$eval_n, temperature 1)"
mkdir -p "$out/eval"
ev() {
  opd-eval run --model "$out/student" --engine hf --data "$world/test.jsonl" --template '{problem}' \
    --thinking off --temperature 1.0 -n "$eval_n" --max-tokens 12 --grader integer --overwrite --quiet "$@"
}
ev --out "$out/eval/step-0.json" > /dev/null
ev --run-dir "$out/distill" --checkpoint $((distill_steps / 2)) --out "$out/eval/step-$((distill_steps / 2)).json" > /dev/null
ev --run-dir "$out/distill" --checkpoint latest --out "$out/eval/step-$distill_steps.json" > /dev/null
opd-eval report "$out/eval" --quiet > /dev/null
ev --model "$out/teacher" --out "$out/teacher-eval.json" |
  python -c 'import json, sys; print("teacher avg@n: %.1f%% (the ceiling)" % (100 * json.load(sys.stdin)["avg"]))' >&2
say "report: $out/eval/report.md, plot: $out/eval/accuracy.png"
opd-eval compare "$out/eval/step-0.json" "$out/eval/step-$distill_steps.json" > "$out/eval/compare.json"
python - "$out/eval/compare.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))["comparisons"][0]
lo, hi = c["ci"]
print(f"student accuracy {c['avg_a']:.1%} -> {c['avg_b']:.1%} after distillation: gain {100 * c['diff']:+.1f} points "
      f"(95% CI {100 * lo:+.1f} to {100 * hi:+.1f}, p = {c['p_value']:.3g}, {c['problems']} held-out problems)")
EOF
