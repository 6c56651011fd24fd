#!/usr/bin/env bash
# Configure the local services for outboxd's tests, one script per service in
# scripts/services/ (each says what it sets up, and runs alone too: sudo scripts/services/nats.sh):
#   - postgres.sh:       wal_level=logical, replication, TLS with a test CA
#   - mariadb.sh:        binary log in ROW format, FULL row image and metadata, TLS
#   - rabbitmq.sh:       running, two plugins, a TLS listener on 127.0.0.1:5671
#   - rabbitmq-stream.sh: the rabbitmq_stream plugin (port 5552), enabled online
#   - nats.sh:           nats-server with JetStream on 127.0.0.1:4222
#   - docker-compose.sh: Debian's package, to validate docker-compose.yml
#   - crypto-vector.sh:  python3-cryptography, for scripts/crypto-vector.py
#   - postgres-versions.sh: PostgreSQL 14, 16, 17, 18 beside the system 15 (ports 5414-5418)
#   - kafka.sh:          tansu (Kafka wire protocol) on 127.0.0.1:9092, and what rdkafka's build needs
#   - php.sh:            PHP for examples/laravel (tests/kit/crypto_php.rs, tests/mariadb/laravel.rs)
#
# For a Debian 12 machine with the distribution packages, run as root, no systemd. Idempotent:
# every run checks everything and changes or restarts a service only when something differs
# from what the tests need (scripts/services/lib.sh). Stops at the first service that fails.
#
# Environment (all optional): OUTBOXD_SERVICES_TIMEOUT (seconds to wait for a service, default
# 120), OUTBOXD_PG_TLS_DIR (the test CA, default /etc/outboxd/tls), OUTBOXD_PG_VERSION and
# OUTBOXD_PG_CLUSTER (postgres.sh).
#
# A new service: its own scripts/services/NAME.sh (sourcing lib.sh), and one line below.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

t0=$SECONDS
service() { # NAME: run scripts/services/NAME.sh under a heading
    echo "== $1"
    "scripts/services/$1.sh"
}

service postgres
service postgres-versions
service mariadb
service rabbitmq
service rabbitmq-stream
service nats
service kafka
service docker-compose
service crypto-vector
service php

echo "services.sh done in $((SECONDS - t0))s"
