#!/usr/bin/env bash
# python3-cryptography: scripts/crypto-vector.py (the independent known answer of
# docs/encryption.md, run by tests/kit/crypto_cli.rs) needs its ChaCha20-Poly1305.
#
# For a Debian 12 machine with the distribution packages, run as root, no systemd; called by
# scripts/services.sh (every service), or alone. Idempotent (scripts/services/lib.sh).
set -euo pipefail
# shellcheck source=scripts/services/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

crypto_vector_section() {
    if python3 -c 'import cryptography.hazmat.primitives.ciphers.aead' >/dev/null 2>&1; then
        say crypto "ok: python3 cryptography"
        return
    fi
    if apt_install python3-cryptography /tmp/outboxd-python-crypto.log; then
        changed crypto "installed Debian's python3-cryptography package"
    else
        say crypto "WARNING: apt-get install -y python3-cryptography failed (see /tmp/outboxd-python-crypto.log); tests/kit/crypto_cli.rs fails until it is installed"
    fi
}

preflight "apt python3" apt-get python3
crypto_vector_section
