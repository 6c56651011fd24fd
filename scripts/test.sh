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
#   OUTBOXD_SKIP_PHP=1      skip the phpunit phase (the Laravel package's tests; PHP not installed)
#   CI=true                 strict: a missing rustfmt or clippy fails the run instead of being
#                           skipped, and the fuzz-check and bench-smoke phases run
#   OUTBOXD_FUZZ_CHECK=1    run the fuzz-check phase outside CI too (type-checks fuzz/ on stable)
#   OUTBOXD_BENCH_SMOKE=1   run the bench-smoke phase outside CI too (every bench once, tiny sizes)
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

CI_STRICT=0
if [[ ${CI:-} == true || ${CI:-} == 1 ]]; then CI_STRICT=1; fi

# ensure_component TOOL COMPONENT: is `cargo TOOL` available (installing COMPONENT if not)?
ensure_component() {
    if cargo "$1" --version >/dev/null 2>&1; then
        return 0
    fi
    if command -v rustup >/dev/null 2>&1 && rustup component add "$2"; then
        cargo "$1" --version >/dev/null 2>&1 && return 0
    fi
    if [[ $CI_STRICT == 1 ]]; then
        echo "test.sh: ERROR: cargo $1 is not available and 'rustup component add $2' failed; under CI=true the $1 phase is required" >&2
        exit 1
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

# The kits without the relay: a service that writes outbox rows (or consumes with the inbox)
# links the library with one database feature. Linted (so a `cfg` that leaves dead code or a
# missing import fails here) and its dependency tree checked: none of the relay's or the
# brokers' clients, nor the other database's. A check, not a build: it compiles no binary.
if ensure_component clippy clippy; then
    phase_begin kit-build
    # FEATURES|crates that must not be in its tree (a regex alternation)
    kits=(
        "postgres|lapin|async-nats|pgwire-replication|hyper|clap|rdkafka|rabbitmq-stream-client|mysql_async"
        "mysql|lapin|async-nats|pgwire-replication|hyper|clap|rdkafka|rabbitmq-stream-client|tokio-postgres"
        "postgres,rabbitmq|async-nats|pgwire-replication|hyper|clap|rdkafka|rabbitmq-stream-client|mysql_async"
        "mysql,rabbitmq|async-nats|pgwire-replication|hyper|clap|rdkafka|rabbitmq-stream-client|tokio-postgres"
        # A relay without broker sinks (stdout only): each sink's client comes with its feature.
        "relay|lapin|async-nats|rdkafka|rabbitmq-stream-client"
        # The binary with NATS as its only broker sink besides RabbitMQ: no librdkafka.
        "cli,nats|rdkafka|rabbitmq-stream-client"
    )
    # Every kit's tree is checked; three are compiled and linted (Postgres alone; MySQL with the
    # consumer kit; the relay without broker sinks, which takes every `cfg` a sink feature
    # gates), which between them take every cfg path a kit has: each feature set compiled
    # cold costs a minute or more of the CI budget.
    for kit in "${kits[@]}"; do
        features=${kit%%|*} forbidden=${kit#*|}
        if [[ $features == postgres || $features == mysql,rabbitmq || $features == relay ]]; then
            cargo clippy "${LOCKED[@]}" --lib --no-default-features --features "$features" -- -D warnings
        fi
        # A failing `cargo tree` stops the run here (set -e), before the grep could pass it.
        tree=$(cargo tree "${LOCKED[@]}" --no-default-features --features "$features" -e normal \
            --prefix none)
        found=$(grep -E "^($forbidden) v" <<<"$tree" | sort -u) || true
        if [[ -n $found ]]; then
            echo "test.sh: ERROR: --no-default-features --features $features pulls in: ${found//$'\n'/, }" >&2
            exit 1
        fi
        echo "kit-build: --no-default-features --features $features: none of $forbidden (ok)"
    done
    phase_end
fi

# fuzz/ is its own workspace with its own lock file: a dependency added to the crate must be
# added there too, or CI's fuzz-check fails on --locked. Resolving it (no compile, offline
# against the registry cache the build below fills anyway) takes a second, so every run does.
if [[ -f fuzz/Cargo.lock ]]; then
    phase_begin fuzz-lock
    if ! cargo metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null; then
        echo "test.sh: ERROR: fuzz/Cargo.lock is out of date with the crate's dependencies; fix: (cd fuzz && cargo update --workspace) and commit fuzz/Cargo.lock" >&2
        exit 1
    fi
    phase_end
fi

phase_begin build
cargo build "${LOCKED[@]}" --all-targets "${CARGO_ARGS[@]}"
phase_end

# The fuzz targets (fuzz/, its own workspace) type-checked on stable, so an API change in
# outboxd::fuzzing cannot leave them broken until the next nightly fuzz run. Without the
# default feature libFuzzer's C++ is not compiled; the shared target dir reuses clippy's
# dependency metadata.
if [[ $CI_STRICT == 1 || ${OUTBOXD_FUZZ_CHECK:-0} == 1 ]]; then
    phase_begin fuzz-check
    CARGO_TARGET_DIR=$PWD/target cargo check "${LOCKED[@]}" --manifest-path fuzz/Cargo.toml \
        --no-default-features --bins
    phase_end
fi

# The Laravel package's PHPUnit tests (against the shared MariaDB and RabbitMQ), after
# Composer's autoloaders for it and its example application, which the Rust tests below drive.
# OUTBOXD_SKIP_PHP=1 (PHP not installed) skips it; the Rust Laravel tests then fail saying so.
if [[ ${OUTBOXD_SKIP_PHP:-0} == 1 ]]; then
    echo "== phase phpunit skipped (OUTBOXD_SKIP_PHP=1)"
else
    phase_begin phpunit
    scripts/php-install.sh
    (cd php/laravel && phpunit --colors=never)
    phase_end
fi

phase_begin test
status=0
cargo test "${LOCKED[@]}" --all-targets "${CARGO_ARGS[@]}" -- --test-threads=2 "${TEST_ARGS[@]}" || status=$?
phase_end "$status"

# Every bench once, at a size that only proves it still runs (the figures mean nothing): the
# bench binaries are already built by the test phase (dev profile), `--bench` makes each run
# its real code path, the variables shrink it.
if [[ $status -eq 0 && ( $CI_STRICT == 1 || ${OUTBOXD_BENCH_SMOKE:-0} == 1 ) ]]; then
    phase_begin bench-smoke
    bench_status=0
    OUTBOXD_BENCH_EVENTS=300 OUTBOXD_BENCH_LATENCY_EVENTS=50 OUTBOXD_BENCH_RATES=100 \
        OUTBOXD_BENCH_RATE=100 OUTBOXD_BENCH_SECONDS=1 OUTBOXD_BENCH_MESSAGES=200 \
        OUTBOXD_BENCH_PRUNE_ROWS=500 OUTBOXD_BENCH_WRITES=100 OUTBOXD_BENCH_BACKLOGS=300 \
        OUTBOXD_BENCH_UNRELATED_ROWS=1000 OUTBOXD_BENCH_ROUNDS=1 OUTBOXD_BENCH_BACKLOG=300 \
        OUTBOXD_BENCH_IDLE_SECONDS=1 OUTBOXD_BENCH_KILLS=2 OUTBOXD_BENCH_KILL_EVENTS=300 \
        OUTBOXD_BENCH_PEER_EVENTS=100 OUTBOXD_BENCH_STALL_SECONDS=5 \
        cargo test "${LOCKED[@]}" --benches "${CARGO_ARGS[@]}" -- --bench || bench_status=$?
    phase_end "$bench_status"
    status=$bench_status
fi
exit "$status"
