#!/usr/bin/env bash
# The one benchmark command: configures the services, then runs every benchmark of the proof
# (docs/benchmarks.md) in release, one after the other, and writes their tables into one report.
#
#   scripts/bench.sh                      # the proof set (about 35 minutes on 2 cores; `peer` needs node and npm)
#   OUTBOXD_BENCHES="latency memory" scripts/bench.sh
#
# Each bench prints Markdown tables on stdout (kept) and progress on stderr (kept in the log).
# The report is target/bench/report.md; each bench's own output is target/bench/NAME.{md,log}.
# Environment read by the benches themselves (OUTBOXD_BENCH_EVENTS, OUTBOXD_BENCH_RATES, …) passes
# through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BENCHES=${OUTBOXD_BENCHES:-"rabbitmq brokers latency poll memory duplicates nats peer"}
OUT=target/bench
mkdir -p "$OUT"

if [[ ${OUTBOXD_SKIP_SERVICES:-0} != 1 ]]; then
    scripts/services.sh >"$OUT/services.log" 2>&1 || { cat "$OUT/services.log"; exit 1; }
fi

# On a shared machine (other builds and tests running), OUTBOXD_BENCH_QUIET=1 (root, cgroup v1
# cpu controller) moves every other process — all but the servers and this script's own
# ancestry — into a cgroup with cpu.shares=2 for the run, and back at the end: the benchmark,
# the relays it starts and the servers then get the CPU whenever they want it, as on a host of
# their own (disk I/O is still shared). Without it, figures move by tens of percent with the
# other load.
QUIET_CG=/sys/fs/cgroup/cpu/outboxd_bench_bg
quiet_off() {
    [[ -d $QUIET_CG ]] || return 0
    while read -r pid; do echo "$pid" >/sys/fs/cgroup/cpu/cgroup.procs 2>/dev/null || true; done <"$QUIET_CG/cgroup.procs"
    rmdir "$QUIET_CG" 2>/dev/null || true
}
if [[ ${OUTBOXD_BENCH_QUIET:-0} == 1 ]]; then
    [[ -d /sys/fs/cgroup/cpu ]] || { echo "bench.sh: OUTBOXD_BENCH_QUIET=1 needs the cgroup v1 cpu controller at /sys/fs/cgroup/cpu" >&2; exit 2; }
    mkdir -p "$QUIET_CG" && echo 2 >"$QUIET_CG/cpu.shares"
    trap quiet_off EXIT
    keep=" $(pgrep -d' ' -x 'postgres|mariadbd|mysqld|beam.smp|epmd|erl_child_setup|inet_gethost') "
    p=$$
    while [[ $p -gt 1 ]]; do keep+=" $p "; p=$(awk '{print $4}' "/proc/$p/stat"); done
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        [[ $keep == *" $pid "* ]] && continue
        # Kernel threads have an empty command line and stay where they are.
        [[ -n $(tr -d '\0' 2>/dev/null <"/proc/$pid/cmdline") ]] || continue
        echo "$pid" >"$QUIET_CG/cgroup.procs" 2>/dev/null || true
    done
fi

report=$OUT/report.md
{
    echo "# outboxd benchmark report"
    echo
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "- date: $(date -u '+%Y-%m-%dT%H:%M:%SZ'), host: $(hostname), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
    echo "- other processes: $([[ ${OUTBOXD_BENCH_QUIET:-0} == 1 ]] && echo 'confined to cpu.shares=2 for the run (OUTBOXD_BENCH_QUIET=1)' || echo 'as they were')"
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
