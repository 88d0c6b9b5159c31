# shellcheck shell=bash
# Sourced by the record scripts (exittrain-verdict.sh, exittrain-gpu.sh): their one stage timer.

timed() {  # timed NAME COMMAND...: runs it, then appends NAME and its wall-clock seconds to $OUT/times.tsv
    local start=$SECONDS
    "${@:2}"
    printf '%s\t%s\n' "$1" $((SECONDS - start)) >> "$OUT/times.tsv"
}
