#!/usr/bin/env bash
# `make fuzz`: coverage-guided fuzzing with AFL++ through cargo-afl, on the stable toolchain.
# Runs each target in tests/fuzz_targets for FUZZ_SECONDS (default 120), starting from
# fuzz/seeds/<target>; every crashing input is copied to fuzz/regressions/<target>/, which
# `make test` replays (tests/fuzz.rs). Not part of `make test` or CI. Prints executions per target.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_SECONDS=${FUZZ_SECONDS:-120}
TARGETS=${TARGETS:-config request key redis_args}

command -v cargo-afl >/dev/null || cargo install --locked cargo-afl
cargo afl config --build >/dev/null 2>&1 || true # builds AFL++ once per toolchain
(cd fuzz && cargo afl build --release --quiet)

export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 AFL_QUIET=1
echo "fuzzing: $(nproc) cores, ${FUZZ_SECONDS}s per target"
status=0
for t in $TARGETS; do
  out=fuzz/out/$t
  rm -rf "$out"; mkdir -p fuzz/out
  (cd fuzz && cargo afl fuzz -V "$FUZZ_SECONDS" -i "seeds/$t" -o "out/$t" "target/release/$t") >"fuzz/out/$t.log" 2>&1 || true
  stats=$out/default/fuzzer_stats
  execs=$(awk -F: '/^execs_done/ {gsub(/ /,"",$2); print $2}' "$stats" 2>/dev/null || echo "?")
  paths=$(awk -F: '/^corpus_count/ {gsub(/ /,"",$2); print $2}' "$stats" 2>/dev/null || echo "?")
  crashes=0
  if compgen -G "$out/default/crashes/id:*" >/dev/null; then
    mkdir -p "fuzz/regressions/$t"
    for c in "$out"/default/crashes/id:*; do
      cp "$c" "fuzz/regressions/$t/$(sha1sum "$c" | cut -c1-16)"
      crashes=$((crashes + 1))
    done
    status=1
  fi
  echo "$t: ${FUZZ_SECONDS}s, $execs executions, $paths corpus entries, $crashes crashes"
done
[ "$status" = 0 ] || echo "crashing inputs were kept in fuzz/regressions/: run make test to replay them"
exit "$status"
