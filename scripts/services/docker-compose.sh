#!/usr/bin/env bash
# docker-compose, Debian's package, installed when missing: tests/surface/compose.rs validates
# docker-compose.yml with it (no Docker engine runs here). A warning, not a failure, when apt
# is unreachable.
#
# For a Debian 12 machine with the distribution packages, run as root, no systemd; called by
# scripts/services.sh (every service), or alone. Idempotent (scripts/services/lib.sh).
set -euo pipefail
# shellcheck source=scripts/services/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

docker_compose_section() {
    if command -v docker-compose >/dev/null 2>&1; then
        say compose "ok: docker-compose $(docker-compose version --short 2>/dev/null || echo present)"
        return
    fi
    # Not a service the relay needs: when apt cannot reach its mirrors, warn and go on.
    if apt_install docker-compose /tmp/outboxd-docker-compose.log; then
        changed compose "installed Debian's docker-compose package"
    else
        say compose "WARNING: apt-get install -y docker-compose failed (see /tmp/outboxd-docker-compose.log); tests/surface/compose.rs fails until it is installed"
    fi
}

preflight apt apt-get
docker_compose_section
