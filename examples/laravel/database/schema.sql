-- The example's tables on MariaDB/MySQL (run by `php artisan migrate`).
-- The invoice table is the business data; the outbox table has a layout common in PHP services, which
-- outboxd reads unchanged: BINARY(16) ids, `event_type` as the topic (outboxd's
-- `--column topic=event_type`), a status ENUM with more states than outboxd's two, and
-- DATETIME(6) timestamps in UTC.
CREATE TABLE IF NOT EXISTS invoices (
    id             BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY,
    number         VARCHAR(32)    NOT NULL UNIQUE,
    customer_name  VARCHAR(255)   NOT NULL,
    tax_id         VARCHAR(32)    NOT NULL,
    tax_id_index   CHAR(16)       NOT NULL,   -- blind index of tax_id (search without decrypting)
    tax_id_index_key VARCHAR(32)  NOT NULL,   -- the blind-index key id it was computed under
    total_cents    BIGINT         NOT NULL,
    issued_at      DATETIME(6)    NOT NULL,
    KEY idx_tax_id_index (tax_id_index)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS outbox (
    id              BINARY(16)   NOT NULL PRIMARY KEY,   -- event id, RFC 4122 byte order (UUID v7)
    aggregate_type  VARCHAR(64)  NOT NULL,               -- sent as x-aggregate-type
    aggregate_id    VARCHAR(64)  NOT NULL,               -- sent as x-aggregate-id
    event_type      VARCHAR(120) NOT NULL,               -- the topic: routing key and `type`
    payload         JSON         NOT NULL,
    version         BIGINT       NULL,                   -- sent as x-aggregate-version
    status          ENUM('pending','published','failed') NOT NULL DEFAULT 'pending',
    created_at      DATETIME(6)  NOT NULL,
    published_at    DATETIME(6)  NULL,
    KEY idx_dispatch (status, created_at),               -- poll mode's claim
    KEY idx_created_at (created_at)                      -- outboxd prune
) ENGINE = InnoDB;

-- The consumer's effect: one ledger line per issued invoice. No unique key on purpose: an effect
-- applied twice would show as two lines (the processed_messages claim is what prevents it).
CREATE TABLE IF NOT EXISTS ledger (
    id             BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    invoice_id     BIGINT UNSIGNED NOT NULL,
    event_id       BINARY(16)      NOT NULL,
    customer_name  VARCHAR(255)    NOT NULL,
    total_cents    BIGINT          NOT NULL,
    booked_at      DATETIME(6)     NOT NULL,
    PRIMARY KEY (id),
    KEY idx_invoice (invoice_id)
) ENGINE = InnoDB;
