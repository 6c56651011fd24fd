-- The relay's own state in the source database: position (binlog file, end position, GTID
-- state) and lease per relay name. `outboxd setup` and the first `outboxd run` create it; this
-- file is the same DDL (src/state/mysql.rs) for those who manage schemas.
CREATE TABLE IF NOT EXISTS outboxd_state (
    name              VARCHAR(64)  NOT NULL PRIMARY KEY,
    source            VARCHAR(16)  NOT NULL,
    slot              VARCHAR(128) NULL,
    publication       VARCHAR(128) NULL,
    epoch             BIGINT       NOT NULL DEFAULT 0,
    lease_holder      VARCHAR(255) NULL,
    lease_renewed_at  DATETIME(6)  NULL,
    lease_expires_at  DATETIME(6)  NULL,
    position          TEXT         NULL,
    position_lsn      VARCHAR(32)  NULL,
    binlog_file       VARCHAR(255) NULL,
    binlog_pos        BIGINT UNSIGNED NULL,
    gtid_state        TEXT         NULL,
    commit_gap_ms     BIGINT       NULL,
    position_commit_at DATETIME(6) NULL,
    initialized_at    DATETIME(6)  NULL,
    created_at        DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at        DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE=InnoDB;
