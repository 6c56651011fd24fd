<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Consumer;

use Illuminate\Database\Connection;
use Outboxd\Laravel\Uuid;
use RuntimeException;

/**
 * The idempotent consumer's bookkeeping, in the transaction of the message's effect: the claim
 * (one processed_messages row per consumer and message id) and the stale gate (the last applied
 * x-aggregate-version per aggregate). A redelivery finds its claim and runs nothing; a crash
 * before the commit leaves neither claim nor effect, so the redelivery applies it. That makes the
 * effect happen once on top of at-least-once delivery.
 */
class Inbox
{
    public function __construct(
        private readonly Connection $db,
        private readonly string $consumer,
    ) {
        if (! in_array($db->getDriverName(), ['mysql', 'mariadb'], true)) {
            throw new RuntimeException("outbox:consume keeps its claims on MySQL or MariaDB; the \"{$db->getName()}\" connection is {$db->getDriverName()}");
        }
    }

    /**
     * Runs `$effect` once per message id for this consumer, and only for a version of the
     * aggregate newer than the last applied; returns whether it ran. Claim, gate and effect
     * commit together or not at all.
     *
     * @param  callable(): void  $effect
     */
    public function process(OutboxMessage $message, callable $effect): bool
    {
        return $this->db->transaction(function () use ($message, $effect): bool {
            if (! $this->claim($message->id)) {
                return false; // a redelivery: its effect is already committed
            }
            if (! $this->newer($message)) {
                return false; // stale: a newer version of the aggregate was applied (the claim stays)
            }
            $effect();

            return true;
        });
    }

    /** True when this message id is new for this consumer. */
    private function claim(string $id): bool
    {
        $inserted = $this->db->table('processed_messages')->insertOrIgnore([
            'consumer' => $this->consumer,
            'message_id' => Uuid::bytes($id),
        ]);
        if ($inserted === 1) {
            return true;
        }
        // INSERT IGNORE also turns errors (truncation, …) into warnings: only a duplicate key
        // (1062) means "already processed".
        foreach ($this->db->select('SHOW WARNINGS') as $warning) {
            if ((int) $warning->Code !== 1062) {
                throw new RuntimeException("processed_messages claim: {$warning->Level} {$warning->Code}: {$warning->Message}");
            }
        }

        return false;
    }

    /**
     * Records the message's version as the aggregate's last applied one when it is newer, and
     * says whether it was. An aggregate is its outbox table (when the relay reads several), its
     * type and its id: aggregate 7 of one table is not aggregate 7 of another. The upsert locks
     * the aggregate's row, so two messages of one aggregate are decided one after the other. A
     * message without a version passes.
     */
    private function newer(OutboxMessage $message): bool
    {
        if ($message->version() === null || $message->aggregateId() === null) {
            return true;
        }
        $affected = $this->db->affectingStatement(
            'INSERT INTO consumer_aggregate_versions (consumer, outbox_table, aggregate_type, aggregate_id, version) VALUES (?, ?, ?, ?, ?)
             ON DUPLICATE KEY UPDATE updated_at = IF(VALUES(version) > version, CURRENT_TIMESTAMP(6), updated_at), version = GREATEST(version, VALUES(version))',
            [$this->consumer, $message->table() ?? '', $message->aggregateType() ?? '', $message->aggregateId(), $message->version()]
        );

        // 1: the aggregate's first version; 2: a newer one replaced the last; 0: not newer.
        return $affected > 0;
    }
}
