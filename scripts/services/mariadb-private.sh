#!/usr/bin/env bash
# Private MariaDB servers for the failover tests (tests/mariadb/mysql_failover.rs): a primary and
# its replicas, each a mariadbd of the Debian package with its own data directory, port and
# socket on 127.0.0.1, never the shared server on 3306. They read no option file of the system
# (--no-defaults), so nothing here can change the shared server.
#
#   mariadb-private.sh start DIR PORT SERVER_ID [OWNER_PID]
#       a server in DIR (its data directory copied from a template made once), binary log
#       mariadb-bin in ROW/FULL/FULL with log_slave_updates, GTID strict mode, root without a
#       password from 127.0.0.1; waits until it answers. With OWNER_PID the server is killed and
#       DIR removed when that process ends (a test binary that panicked or was killed leaves
#       nothing running). Starting a DIR whose server was killed starts it again on its data.
#   mariadb-private.sh kill DIR     SIGKILL the server (a crash: nothing is flushed)
#   mariadb-private.sh stop DIR     SIGKILL the server and its watchdog, remove DIR
#
# Run as root (the tests do). Environment: OUTBOXD_MARIADB_TEMPLATE, where the template data
# directory lives (default /var/lib/outboxd/mariadb-template; made once, about 3 s);
# OUTBOXD_MARIADB_EXTRA, option lines appended to the server's (e.g. log_slave_updates=OFF).
set -euo pipefail

MARIADBD=/usr/sbin/mariadbd
TEMPLATE=${OUTBOXD_MARIADB_TEMPLATE:-/var/lib/outboxd/mariadb-template}

die() {
    printf 'mariadb-private.sh: ERROR: %s\n' "$*" >&2
    exit 1
}

[[ $EUID -eq 0 ]] || die "run as root (the failover tests run as root)"
[[ -x $MARIADBD ]] || die "no $MARIADBD: apt-get install -y mariadb-server mariadb-client"
command -v mariadb-install-db >/dev/null || die "no mariadb-install-db: apt-get install -y mariadb-server"

# The template: a data directory with root allowed from 127.0.0.1 without a password
# (mariadb-install-db's `normal` root accounts include root@127.0.0.1), and no
# binary log yet (each server starts its own at mariadb-bin.000001). Made under a lock, once.
template() {
    [[ -f $TEMPLATE/.ready ]] && return 0
    mkdir -p "$(dirname "$TEMPLATE")"
    exec 9>"$TEMPLATE.lock"
    flock 9
    if [[ ! -f $TEMPLATE/.ready ]]; then
        rm -rf "$TEMPLATE"
        mkdir -p "$TEMPLATE"
        chown mysql:mysql "$TEMPLATE"
        mariadb-install-db --no-defaults --datadir="$TEMPLATE" --user=mysql \
            --auth-root-authentication-method=normal --skip-test-db >"$TEMPLATE.log" 2>&1 ||
            die "mariadb-install-db failed: see $TEMPLATE.log"
        touch "$TEMPLATE/.ready"
    fi
    flock -u 9
}

ping_server() { # DIR PORT
    mysql -uroot -h127.0.0.1 -P"$2" --protocol=TCP --connect-timeout=2 -N -B -e "SELECT 1" >/dev/null 2>&1
}

start() {
    local dir=$1 port=$2 server_id=$3 owner=${4:-}
    template
    mkdir -p "$dir"
    if [[ ! -d $dir/data ]]; then
        cp -a "$TEMPLATE" "$dir/data"
        rm -f "$dir/data/.ready"
    fi
    cat >"$dir/my.cnf" <<EOF
[mariadbd]
datadir=$dir/data
port=$port
bind-address=127.0.0.1
socket=$dir/mysqld.sock
pid-file=$dir/mysqld.pid
log-error=$dir/error.log
user=mysql
server_id=$server_id
log_bin=mariadb-bin
log_slave_updates=ON
binlog_format=ROW
binlog_row_image=FULL
binlog_row_metadata=FULL
gtid_strict_mode=ON
relay_log=relay-bin
skip_name_resolve=ON
skip_slave_start=ON
innodb_buffer_pool_size=32M
innodb_log_file_size=16M
innodb_flush_log_at_trx_commit=2
sync_binlog=0
performance_schema=OFF
max_connections=200
expire_logs_days=7
${OUTBOXD_MARIADB_EXTRA:-}
EOF
    chown -R mysql:mysql "$dir"
    chmod 0755 "$dir"
    setsid "$MARIADBD" --defaults-file="$dir/my.cnf" </dev/null >>"$dir/error.log" 2>&1 &
    local pid=$! deadline=$((SECONDS + 60))
    until ping_server "$dir" "$port"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            die "mariadbd in $dir exited at start: $(tail -n 20 "$dir/error.log")"
        fi
        ((SECONDS < deadline)) || die "mariadbd in $dir did not answer on 127.0.0.1:$port within 60 s: $(tail -n 20 "$dir/error.log")"
        sleep 0.1
    done
    echo "$pid" >"$dir/server.pid"
    if [[ -n $owner && ! -f $dir/watchdog.pid ]]; then
        # Ends the server and removes its directory once the owner (the test binary) is gone.
        setsid bash -c "while kill -0 $owner 2>/dev/null; do sleep 1; done
            kill -9 \$(cat '$dir/server.pid' 2>/dev/null) 2>/dev/null; sleep 0.5; rm -rf '$dir'" \
            </dev/null >/dev/null 2>&1 &
        echo $! >"$dir/watchdog.pid"
    fi
    echo "mariadb-private: $dir on 127.0.0.1:$port server_id=$server_id pid=$pid"
}

kill_server() {
    local dir=$1 pid
    pid=$(cat "$dir/server.pid" 2>/dev/null || true)
    [[ -n $pid ]] || return 0
    kill -9 "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null; do
        ((SECONDS < deadline)) || die "mariadbd $pid in $dir did not die"
        sleep 0.05
    done
    rm -f "$dir/server.pid"
}

stop() {
    local dir=$1
    [[ -d $dir ]] || return 0
    kill_server "$dir"
    local w
    w=$(cat "$dir/watchdog.pid" 2>/dev/null || true)
    [[ -n $w ]] && kill "$w" 2>/dev/null || true
    rm -rf "$dir"
}

case ${1:-} in
start) start "${2:?DIR}" "${3:?PORT}" "${4:?SERVER_ID}" "${5:-}" ;;
kill) kill_server "${2:?DIR}" ;;
stop) stop "${2:?DIR}" ;;
template) template ;;
*) die "usage: $0 start DIR PORT SERVER_ID [OWNER_PID] | kill DIR | stop DIR | template" ;;
esac
