#!/usr/bin/env bash
# The one test command: configure the local services, then format check, clippy, build, tests.
# Prints `== phase NAME took Ns` after every phase (also when it fails) and the total.
# Exits with the first failing phase's status, else with the tests' status.
#
# Environment (all optional):
#   OUTBOXD_TEST_ARGS       extra arguments for the test binaries (after `--`), e.g. a filter
#                           or --nocapture: OUTBOXD_TEST_ARGS='postgres --nocapture' scripts/test.sh
#   OUTBOXD_CARGO_ARGS      extra arguments for cargo clippy/build/test (before `--`), e.g. --release
#   OUTBOXD_SKIP_SERVICES=1 do not run scripts/services.sh (services are managed elsewhere)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

TOTAL_START=$SECONDS
PHASE=""
PHASE_START=0

phase_begin() {
    PHASE=$1
    PHASE_START=$SECONDS
    echo "== phase $PHASE"
}

phase_end() { # [STATUS]
    local note=""
    if [[ ${1:-0} -ne 0 ]]; then note=" (FAILED, exit $1)"; fi
    echo "== phase $PHASE took $((SECONDS - PHASE_START))s$note"
    PHASE=""
}

# shellcheck disable=SC2317 # invoked by the EXIT trap
on_exit() {
    local rc=$?
    if [[ -n $PHASE ]]; then
        echo "== phase $PHASE took $((SECONDS - PHASE_START))s (FAILED, exit $rc)"
    fi
    echo "== total took $((SECONDS - TOTAL_START))s (exit $rc)"
}
trap on_exit EXIT

warn() { echo "test.sh: WARNING: $*" >&2; }

# ensure_component TOOL COMPONENT: is `cargo TOOL` available (installing COMPONENT if not)?
ensure_component() {
    if cargo "$1" --version >/dev/null 2>&1; then
        return 0
    fi
    if command -v rustup >/dev/null 2>&1 && rustup component add "$2"; then
        cargo "$1" --version >/dev/null 2>&1 && return 0
    fi
    warn "cargo $1 is not available and 'rustup component add $2' failed (offline?): skipping the $1 phase"
    return 1
}

LOCKED=()
if [[ -f Cargo.lock ]]; then
    LOCKED=(--locked)
fi
# word splitting of the extra-argument variables is intended
# shellcheck disable=SC2206
CARGO_ARGS=(${OUTBOXD_CARGO_ARGS:-})
# shellcheck disable=SC2206
TEST_ARGS=(${OUTBOXD_TEST_ARGS:-})

if [[ ${OUTBOXD_SKIP_SERVICES:-0} == 1 ]]; then
    echo "== phase services skipped (OUTBOXD_SKIP_SERVICES=1)"
else
    phase_begin services
    scripts/services.sh
    phase_end
fi

if ensure_component fmt rustfmt; then
    phase_begin fmt
    cargo fmt --all -- --check
    phase_end
fi

if ensure_component clippy clippy; then
    phase_begin clippy
    cargo clippy "${LOCKED[@]}" --all-targets "${CARGO_ARGS[@]}" -- -D warnings
    phase_end
fi

phase_begin build
cargo build "${LOCKED[@]}" --all-targets "${CARGO_ARGS[@]}"
phase_end

phase_begin test
status=0
cargo test "${LOCKED[@]}" --all-targets "${CARGO_ARGS[@]}" -- --test-threads=2 "${TEST_ARGS[@]}" || status=$?
phase_end "$status"
exit "$status"
