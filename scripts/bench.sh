#!/usr/bin/env bash
# The one benchmark command: configures the services, then runs every benchmark of the proof
# (docs/benchmarks.md) in release, one after the other, and writes their tables into one report.
#
#   scripts/bench.sh                      # all of them (about 20–30 minutes on 2 cores)
#   OUTBOXD_BENCHES="latency memory" scripts/bench.sh
#
# Each bench prints Markdown tables on stdout (kept) and progress on stderr (kept in the log).
# The report is target/bench/report.md; each bench's own output is target/bench/NAME.{md,log}.
# Environment read by the benches themselves (OUTBOXD_BENCH_EVENTS, OUTBOXD_BENCH_RATES, …) passes
# through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BENCHES=${OUTBOXD_BENCHES:-"rabbitmq drain drain_mysql latency poll memory duplicates"}
OUT=target/bench
mkdir -p "$OUT"

if [[ ${OUTBOXD_SKIP_SERVICES:-0} != 1 ]]; then
    scripts/services.sh >"$OUT/services.log" 2>&1 || { cat "$OUT/services.log"; exit 1; }
fi

# On a shared machine (other builds running), OUTBOXD_BENCH_PRIORITY=1 (root) raises the
# benchmark, the relay it starts and the three servers to nice -10 for the run and puts them back
# at the end: the figures then describe a host whose other load yields to the data path.
if [[ ${OUTBOXD_BENCH_PRIORITY:-0} == 1 ]]; then
    # Every thread: on Linux a nice value belongs to a thread, and the servers are multithreaded.
    servers=$(for p in $(pgrep -x 'postgres|mariadbd|mysqld|beam.smp|epmd'); do ls "/proc/$p/task"; done | tr '\n' ' ')
    # shellcheck disable=SC2086 # a list of pids
    renice -n -10 -p $$ $servers >/dev/null
    trap 'renice -n 0 -p '"$servers"' >/dev/null 2>&1 || true' EXIT
fi

report=$OUT/report.md
{
    echo "# outboxd benchmark report"
    echo
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "- date: $(date -u '+%Y-%m-%dT%H:%M:%SZ'), host: $(hostname), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
    echo "- priority: $([[ ${OUTBOXD_BENCH_PRIORITY:-0} == 1 ]] && echo 'benchmark and servers at nice -10 (shared machine)' || echo 'default')"
    echo "- $(cargo --version), $(psql --version | head -1), $(mariadb --version | sed 's/,.*//'), RabbitMQ $(rabbitmqctl version 2>/dev/null || echo '?')"
} >"$report"

# Build once, so the first bench's time is not the compiler's.
cargo bench --no-run --locked $(for b in $BENCHES; do printf -- '--bench %s ' "$b"; done) >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }

status=0
for b in $BENCHES; do
    load_before=$(cut -d' ' -f1-3 /proc/loadavg)
    start=$SECONDS
    echo "== bench $b"
    if cargo bench --locked --bench "$b" >"$OUT/$b.md" 2>"$OUT/$b.log"; then
        result=ok
    else
        result="FAILED (exit $?, see $OUT/$b.log)"
        status=1
    fi
    took=$((SECONDS - start))
    echo "== bench $b took ${took}s: $result"
    {
        echo
        echo "## $b"
        echo
        echo "_${took} s, load average before: ${load_before}, after: $(cut -d' ' -f1-3 /proc/loadavg); ${result}_"
        echo
        grep -v '^\s*$' "$OUT/$b.md" | grep -v '^Running\|^test result' || true
    } >>"$report"
done
echo "== report: $report"
exit $status
