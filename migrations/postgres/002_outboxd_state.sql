-- The relay's own state: position, lease and slot per relay name. `outboxd setup` and the
-- first `outboxd run` create it; this file is the same DDL for those who manage schemas.
CREATE TABLE IF NOT EXISTS outboxd_state (
    name              text PRIMARY KEY,
    source            text NOT NULL,
    slot              text,
    publication       text,
    epoch             bigint NOT NULL DEFAULT 0,
    lease_holder      text,
    lease_renewed_at  timestamptz,
    lease_expires_at  timestamptz,
    position          text,
    position_lsn      pg_lsn,
    binlog_file       text,
    binlog_pos        bigint,
    gtid_state        text,
    commit_gap_ms     bigint,
    replay_since      timestamptz,
    position_commit_at timestamptz,
    slot_created_lsn  pg_lsn,
    snapshot_key      text,
    initialized_at    timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);
