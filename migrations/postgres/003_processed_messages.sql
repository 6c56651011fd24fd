-- The consumer side of effectively-once (docs/consumer.md). A consumer records every event id
-- it has processed in the same transaction as the effect, claim first:
--   INSERT INTO processed_messages (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING
-- 0 rows = a repeat, run nothing. One table serves many consumers: the key starts with the
-- consumer's name, so each consumer sees every event once.
CREATE TABLE IF NOT EXISTS processed_messages (
    consumer      varchar(100) COLLATE "C" NOT NULL,   -- the consumer's name (Inbox::new)
    message_id    uuid         NOT NULL,               -- the event id = AMQP message_id
    processed_at  timestamptz  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
-- `outboxd prune --table processed_messages --older-than 7d` walks this index oldest first.
CREATE INDEX IF NOT EXISTS processed_messages_processed_at ON processed_messages (processed_at);

-- The optional stale gate: the last applied x-aggregate-version per consumer and aggregate,
-- an aggregate being the outbox table its events come from (x-outbox-table, '' when the relay
-- reads one table), its type (x-aggregate-type, '' when not sent) and its id. A message
-- whose version is not newer is dropped (in the same transaction as the claim). One row per
-- aggregate, kept as long as the aggregate may still receive events: not pruned. COLLATE "C":
-- byte-for-byte comparison. Tables created before (keyed on the id alone): the kit's setup
-- migrates them in place (docs/consumer.md).
CREATE TABLE IF NOT EXISTS consumer_aggregate_versions (
    consumer        varchar(100) COLLATE "C" NOT NULL,
    outbox_table    text COLLATE "C"         NOT NULL DEFAULT '',
    aggregate_type  text COLLATE "C"         NOT NULL DEFAULT '',
    aggregate_id    text COLLATE "C"         NOT NULL,
    version         bigint                   NOT NULL,
    updated_at      timestamptz              NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, outbox_table, aggregate_type, aggregate_id)
);
