-- The outbox table for MySQL 8 / MariaDB (docs/message-format.md). MariaDB stores JSON as
-- LONGTEXT with a json_valid check: the payload then travels byte for byte.
CREATE TABLE IF NOT EXISTS outbox (
    id            BINARY(16)   NOT NULL,        -- event id = idempotency key (RFC 4122 byte order)
    aggregate_id  BIGINT       NOT NULL,        -- ordering and partition key
    topic         VARCHAR(120) NOT NULL,
    payload       JSON         NOT NULL,
    status        ENUM('pending','published') NOT NULL DEFAULT 'pending',
    created_at    DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6), -- the session's zone: see --source-time-zone
    published_at  DATETIME(6)  NULL,
    PRIMARY KEY (id),
    KEY idx_dispatch (status, created_at),       -- poll mode scans this index
    KEY idx_created_at (created_at)              -- outboxd prune: its DELETE range stays on old rows
);
