# Shared by the recipes (sourced, not run): argument parsing and the pipeline runner.
# Each recipe sets its defaults in shell variables first, then sources this file with "$@".
#
# Flags every recipe takes (defaults come from the recipe):
#   --model M  --teacher T  --post P  --pre Q  --out DIR  --steps K  --data D  --group-size N
#   --groups G  --max-tokens L  --engine auto|vllm|hf  --lr X  --lora-r R  --lora-alpha A
#   --max-lag L   (0 = strictly on-policy; 1 = sampling overlaps training; default per recipe)
#   --save-every N   checkpoint (optimizer state included, fsynced: what --resume needs) every N steps,
#                 default 10; every step's adapter reaches the rollout through opd-train --share-policy
#   --extra-rollout "FLAGS"  --extra-score "FLAGS"  --extra-train "FLAGS"   (word-split, appended)
#   --gen-factor F  --overlong-buffer B   (dapo only)
#   --bin DIR   where the opd-* executables are (default: on PATH)
#   --no-check  skip the preflight: each recipe first runs opd-check with its own flags on 2 prompts
#               (docs/check.md; its report goes to stderr, a FAIL stops the recipe)
#   -h|--help

opd_usage() {  # the recipe's comment header
    sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
}

opd_parse() {
    EXTRA_ROLLOUT=${EXTRA_ROLLOUT:-}; EXTRA_SCORE=${EXTRA_SCORE:-}; EXTRA_TRAIN=${EXTRA_TRAIN:-}; BIN=${BIN:-}
    while [ $# -gt 0 ]; do
        case "$1" in
            -h|--help) opd_usage; exit 0 ;;
            --no-check) NO_CHECK=1; shift ;;
            --model|--teacher|--post|--pre|--out|--steps|--data|--group-size|--groups|--max-tokens|--max-lag|--save-every|--engine|--lr|--lora-r|--lora-alpha|--extra-rollout|--extra-score|--extra-train|--bin|--gen-factor|--overlong-buffer)
                [ $# -ge 2 ] || { echo "Error: $1 needs a value" >&2; exit 2; }
                local name=${1#--}; name=${name//-/_}; name=${name^^}
                [ "$name" != GROUPS ] || name=NGROUPS  # GROUPS is a bash builtin variable
                printf -v "$name" '%s' "$2"; shift 2 ;;
            --*=*)
                local key=${1%%=*} value=${1#*=}; shift; set -- "$key" "$value" "$@" ;;
            *) echo "Error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
        esac
    done
    : "${OUT:?--out DIR is required}"
    if [ -n "$BIN" ]; then BIN=${BIN%/}/; fi
    case "$ENGINE" in auto|vllm|hf) ;; *) echo "Error: --engine must be auto, vllm or hf, got '$ENGINE'" >&2; exit 2 ;; esac
    [[ "${MAX_LAG:-0}" =~ ^[0-9]+$ ]] || { echo "Error: --max-lag must be a non-negative integer, got '$MAX_LAG'" >&2; exit 2; }
    SAVE_EVERY=${SAVE_EVERY:-10}
    for n in STEPS GROUP_SIZE NGROUPS MAX_TOKENS SAVE_EVERY ${GEN_FACTOR:+GEN_FACTOR}; do
        [[ "${!n}" =~ ^[1-9][0-9]*$ ]] || { local flag=${n#N}; echo "Error: --$(echo "${flag,,}" | tr _ -) must be a positive integer, got '${!n}'" >&2; exit 2; }
    done
}

# opd_words NAME STRING: split an --extra-* string into the array NAME (empty string: empty array).
opd_words() {
    local -n _arr=$1
    read -r -a _arr <<< "$2" || true
}

# opd_check_first FLAGS...: the preflight (opd-check) with the recipe's model, engine, data, group size and
# --max-tokens plus FLAGS (the recipe's sampling and objective flags), on 2 prompts; unless --no-check.
opd_check_first() {
    [ "${NO_CHECK:-0}" = 1 ] && return 0
    "${BIN}opd-check" --model "$MODEL" --engine "$ENGINE" -n "$GROUP_SIZE" --max-tokens "$MAX_TOKENS" --limit 2 \
        --quiet "$@" "$DATA" >&2 \
        || { echo "Error: opd-check found a mismatch (above); fix it, or skip the preflight with --no-check" >&2; exit 1; }
}
