-- The outbox table (docs/message-format.md). Producers insert into it in the same transaction as their
-- business rows; outboxd relays each INSERT. `aggregate_id` may also be bigint or uuid, and
-- `payload` jsonb (json keeps the body byte for byte; jsonb re-renders it).
CREATE TABLE IF NOT EXISTS outbox (
    id            uuid         PRIMARY KEY,              -- event id = message id = idempotency key
    aggregate_id  text         NOT NULL,                 -- ordering and partition key
    topic         varchar(120) NOT NULL,                 -- routing key
    payload       json         NOT NULL,
    status        text         NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'published')),
    created_at    timestamptz  NOT NULL DEFAULT now(),
    published_at  timestamptz,
    headers       jsonb,                                 -- optional, copied into message headers
    version       bigint,                                -- optional aggregate version
    seq           bigint       GENERATED ALWAYS AS IDENTITY -- poll mode: insert order within a transaction
);
-- Poll mode's scan (status, created_at), and a partial index that stays small. Poll mode claims
-- in (created_at, seq) order: a transaction's rows share created_at (now()), seq keeps their
-- insert order (`outboxd setup --mode poll` adds both to an older table).
CREATE INDEX IF NOT EXISTS idx_dispatch ON outbox (status, created_at);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (created_at, seq) WHERE status = 'pending';
