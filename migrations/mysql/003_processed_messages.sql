-- The consumer side of effectively-once for MySQL 8 / MariaDB (docs/consumer.md). A consumer
-- records every event id it has processed in the same transaction as the effect, claim first:
--   INSERT IGNORE INTO processed_messages (consumer, message_id) VALUES (?, ?)
-- 0 affected rows with only a duplicate-key warning = a repeat, run nothing (any other warning
-- is an error: INSERT IGNORE turns errors such as truncation into warnings).
-- Names and ids are VARBINARY: compared byte for byte, so `Billing` and `billing`, `ORD-a` and
-- `ord-A`, `café` and `cafe ` are different keys (a VARCHAR's default collation merges them).
-- Tables created before: the kit's setup migrates them in place (docs/consumer.md).
CREATE TABLE IF NOT EXISTS processed_messages (
    consumer      VARBINARY(100) NOT NULL,                        -- the consumer's name (UTF-8)
    message_id    BINARY(16)   NOT NULL,                          -- event id, RFC 4122 byte order
    processed_at  DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, message_id),
    KEY idx_processed_at (processed_at)   -- outboxd prune: DELETE … ORDER BY processed_at LIMIT n
) ENGINE = InnoDB;

-- The optional stale gate: the last applied x-aggregate-version per consumer and aggregate,
-- an aggregate being the outbox table its events come from (x-outbox-table, '' when the relay
-- reads one table), its type (x-aggregate-type, '' when not sent) and its id.
CREATE TABLE IF NOT EXISTS consumer_aggregate_versions (
    consumer        VARBINARY(100)  NOT NULL,
    outbox_table    VARBINARY(255)  NOT NULL DEFAULT '',
    aggregate_type  VARBINARY(255)  NOT NULL DEFAULT '',
    aggregate_id    VARBINARY(1024) NOT NULL,
    version         BIGINT          NOT NULL,
    updated_at      DATETIME(6)     NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, outbox_table, aggregate_type, aggregate_id)
) ENGINE = InnoDB;
