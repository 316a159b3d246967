#!/usr/bin/env bash
# The fuzzing campaign: builds the targets with coverage instrumentation (nightly toolchain,
# no cargo-fuzz needed), runs each one in turn for FUZZ_SECONDS (default 180) starting from the
# committed seeds in `seeds/<target>/`, and prints executions and findings per target.
#
#   fuzz/run.sh                  # every target, 180 s each
#   FUZZ_SECONDS=30 fuzz/run.sh key form
#
# Inputs the fuzzer finds interesting go to `corpus/<target>/`, crashes, timeouts and
# out-of-memory inputs to `artifacts/<target>/` (both ignored by git); logs to `logs/`.
# Replay one input with `fuzz/target/<host>/release/<target> <file>`.
# Exits 1 if any target found something.
set -euo pipefail
cd "$(dirname "$0")"

seconds="${FUZZ_SECONDS:-180}"
# Per-input bounds: a slow input is a finding (timeout), and so is one that needs much memory.
timeout_secs="${FUZZ_TIMEOUT_SECS:-10}"
rss_limit_mb="${FUZZ_RSS_LIMIT_MB:-2048}"
max_len="${FUZZ_MAX_LEN:-4096}"
all_targets=(key json_fingerprint form stored_fields cache_value sql_row)
if [ "$#" -gt 0 ]; then targets=("$@"); else targets=("${all_targets[@]}"); fi

host="$(rustc +nightly -vV | sed -n 's/^host: //p')"
# The instrumentation cargo-fuzz uses (without a sanitizer: the crate forbids unsafe code).
# With an explicit --target the flags reach only the fuzzed code, not build scripts or macros.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
cargo +nightly build --release --target "$host" --bins
bin="target/$host/release"

mkdir -p logs
summary=()
found_any=0
for target in "${targets[@]}"; do
  mkdir -p "corpus/$target" "artifacts/$target"
  log="logs/$target.log"
  start="logs/.$target.start"
  touch "$start" # findings are the artifacts made after this
  echo "== $target: ${seconds}s" >&2
  set +e
  "$bin/$target" "corpus/$target" "seeds/$target" \
    -max_total_time="$seconds" -timeout="$timeout_secs" -rss_limit_mb="$rss_limit_mb" \
    -max_len="$max_len" -artifact_prefix="artifacts/$target/" -print_final_stats=1 \
    >"$log" 2>&1
  status=$?
  set -e
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
  findings="$(find "artifacts/$target" -type f -newer "$start" | wc -l)"
  corpus="$(find "corpus/$target" -type f | wc -l)"
  if [ "$status" -ne 0 ] || [ "$findings" -gt 0 ]; then found_any=1; fi
  summary+=("$(printf '%-18s %12s %9s %8s %7s' "$target" "${execs:-?}" "$corpus" "$findings" "$status")")
done

printf '\n%-18s %12s %9s %8s %7s\n' target executions corpus findings exit
printf '%s\n' "${summary[@]}"
if [ "$found_any" -ne 0 ]; then
  echo "findings: see artifacts/<target>/ and logs/<target>.log" >&2
  exit 1
fi
