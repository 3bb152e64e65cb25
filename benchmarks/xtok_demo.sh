#!/usr/bin/env bash
# Issue 20: on-policy distillation from a teacher with ANOTHER TOKENIZER, on the demo world (CPU, minutes).
#
#   1. The demo world (python -m opd_common.demo): its base model splits digits with a 2,048-id BPE.
#   2. The student: step 250 of a 600-step `opd-train --loss sft` run on the gold solutions (as scripts/demo.sh).
#   3. The teacher: another tiny model whose tokenizer is a smaller BPE (1,024 ids: the student's tokens with ids
#      of 1,024 or more do not exist for it; opd-score --align ids refuses it), trained with sft on the same gold
#      solutions tokenized by ITS tokenizer.
#   4. Distillation through the real pipeline, strictly on-policy:
#        opd-rollout --follow RUN | opd-score --teacher t=TEACHER --teacher-prompt FILE | opd-train --loss rkl
#      opd-score sees the other tokenizer and scores the response text (teachers.t.text: aligned chunks);
#      rkl's advantages are per chunk (docs/losses.md, Aligned chunks). DEMO_LOSS=uld scores --topk 16 and
#      trains --loss uld instead. rkl at lr 5e-4 from step 250: +24.1 points (docs/benchmarks.md, issue 20).
#   5. opd-eval of the student before and after on the 200 held-out problems; opd-eval compare.
#
# Output in $OPD_XTOK_OUT (default out/xtok-demo); the last line printed is the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" TOKENIZERS_PARALLELISM=false
out=${OPD_XTOK_OUT:-out/xtok-demo}
sft_steps=${DEMO_SFT_STEPS:-400}
student_step=${DEMO_STUDENT_STEP:-250}
student_sft_steps=${DEMO_STUDENT_SFT_STEPS:-600}
distill_steps=${DEMO_DISTILL_STEPS:-100}
lr=${DEMO_LR:-5e-4}
loss=${DEMO_LOSS:-rkl}  # rkl (sampled chunks) or uld (sorted top-16 where chunks start: scored with --topk 16)
topk=$([ "$loss" = uld ] && echo "--topk 16" || true)
eval_n=${DEMO_EVAL_N:-4}
world=$out/world
say() { echo "== $(date +%T) $*" >&2; }
sft() {  # sft MODEL RECORDS RUN STEPS SAVE_EVERY
  opd-train --model "$1" --loss sft --out "$3" --overwrite --max-steps "$4" --batch-size 64 --lora-r 32 \
    --lora-alpha 64 --lora-targets all-linear --lr 3e-3 --lr-schedule cosine --warmup-steps 20 --save-every "$5" \
    --quiet < <(for _ in $(seq 20); do cat "$2"; done)
}

say "1/5 demo world and the teacher's base (another tokenizer) -> $world"
python -m opd_common.demo "$world"
[ -f "$world/teacher-sft.jsonl" ] || python - "$world" <<'PY'
import json, sys
from pathlib import Path
from opd_common.demo import MODEL, sft_record
from opd_common.records import pack_tree
from opd_common.tiny import build_model, build_tokenizer
world = Path(sys.argv[1])
base = world / "teacher-base"
tok = build_tokenizer(vocab_size=1024, split_digits=True)
build_model(tok, seed=1, **MODEL).save_pretrained(base)
tok.save_pretrained(base)
rows = [json.loads(line) for line in open(world / "train.jsonl")]
with open(world / "teacher-sft.jsonl", "w") as f:
    for row in rows:
        f.write(json.dumps(sft_record(tok, row)) + "\n")
PY
printf '{problem}' > "$world/teacher-prompt.fmt"

# stages 2 and 3 are skipped when their merged model is there (a rerun with other distillation settings)
if [ ! -f "$out/student/config.json" ]; then
  say "2/5 student: step $student_step of a $student_sft_steps-step sft run on the gold solutions (as scripts/demo.sh)"
  sft "$world/base" "$world/sft.jsonl" "$out/sft-student" "$student_sft_steps" "$student_step"
  python -m opd_common.demo merge "$world/base" "$(printf '%s/sft-student/checkpoint-%06d' "$out" "$student_step")" \
    "$out/student"
fi
if [ ! -f "$out/teacher/config.json" ]; then
  say "3/5 teacher (another tokenizer): sft $sft_steps steps"
  sft "$world/teacher-base" "$world/teacher-sft.jsonl" "$out/sft-teacher" "$sft_steps" "$sft_steps"
  python -m opd_common.demo merge "$world/teacher-base" "$out/sft-teacher/$(cat "$out/sft-teacher/latest")" \
    "$out/teacher"
fi

say "4/5 on-policy distillation over aligned chunks: $distill_steps steps, $loss, lr $lr"
rm -rf "$out/distill"
# shellcheck disable=SC2086
opd-rollout --model "$out/student" --engine hf --template '{problem}' --thinking off -n 4 \
    --temperature 1.0 --max-tokens 12 --batch-prompts 16 --follow "$out/distill" --max-lag 0 --quiet \
    "$world/train.jsonl" |
  opd-score --teacher "t=$out/teacher" --teacher-prompt "$world/teacher-prompt.fmt" --teacher-thinking off \
    $topk --quiet |
  opd-train --model "$out/student" --loss "$loss" --out "$out/distill" --max-steps "$distill_steps" \
    --batch-groups 16 --lora-r 32 --lora-alpha 64 --lora-targets all-linear --lr "$lr" --save-every 1 --quiet

say "5/5 evaluation on the 200 held-out problems (avg@$eval_n, temperature 1)"
mkdir -p "$out/eval"
ev() {
  opd-eval run --model "$out/student" --engine hf --data "$world/test.jsonl" --template '{problem}' \
    --thinking off --temperature 1.0 -n "$eval_n" --max-tokens 12 --grader integer --overwrite --quiet "$@"
}
ev --out "$out/eval/step-0.json" > /dev/null
ev --run-dir "$out/distill" --checkpoint latest --out "$out/eval/step-$distill_steps.json" > /dev/null
ev --model "$out/teacher" --out "$out/teacher-eval.json" |
  python -c 'import json, sys; print("teacher avg@n: %.1f%%" % (100 * json.load(sys.stdin)["avg"]))' >&2
opd-eval compare "$out/eval/step-0.json" "$out/eval/step-$distill_steps.json" > "$out/eval/compare.json"
python - "$out/eval/compare.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["comparisons"][0]
lo, hi = c["ci"]
print(f"student accuracy {c['avg_a']:.1%} -> {c['avg_b']:.1%} after distillation from a teacher with another "
      f"tokenizer: gain {100 * c['diff']:+.1f} points (95% CI {100 * lo:+.1f} to {100 * hi:+.1f}, "
      f"p = {c['p_value']:.3g}, {c['problems']} held-out problems)")
PY
