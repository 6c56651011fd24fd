<?php

declare(strict_types=1);

namespace Outboxd\Laravel;

use DateTimeImmutable;
use DateTimeZone;
use Illuminate\Contracts\Support\Arrayable;
use Illuminate\Database\ConnectionInterface;
use Illuminate\Database\ConnectionResolverInterface;
use JsonSerializable;
use Outboxd\Laravel\Encryption\TopicEncryption;
use Outboxd\Laravel\Exceptions\OutsideTransactionException;

/**
 * The producer's half of the transactional outbox: one row in the outbox table on the
 * application's database connection, inside the caller's transaction, so the event commits or
 * rolls back with the business rows. outboxd relays the committed rows (binlog, WAL or poll
 * mode); nothing here talks to a broker.
 */
class Outbox
{
    private const JSON_FLAGS = JSON_UNESCAPED_SLASHES | JSON_UNESCAPED_UNICODE | JSON_PRESERVE_ZERO_FRACTION | JSON_THROW_ON_ERROR;

    public function __construct(
        private readonly ConnectionResolverInterface $db,
        private readonly TopicEncryption $encryption,
        private readonly ?string $connection = null,
        private readonly string $table = 'outbox',
    ) {
    }

    /**
     * Writes one event and returns its id: a UUID v7, which is also the message's `message_id`
     * and the consumers' idempotency key.
     *
     * @param  string  $topic  routing key and message `type`, e.g. `invoice.issued`
     * @param  string|int  $aggregateId  the ordering key, sent as `x-aggregate-id`
     * @param  array|Arrayable|JsonSerializable  $payload  the message body (a JSON object)
     * @param  string|null  $aggregateType  sent as `x-aggregate-type`; by default the topic up to its first dot
     * @param  int|null  $version  the aggregate's version, sent as `x-aggregate-version` (consumers drop stale versions)
     *
     * @throws OutsideTransactionException when no transaction is open on the outbox's connection
     * @throws Encryption\CryptoException when the topic's sensitive fields cannot be sealed
     */
    public function write(string $topic, string|int $aggregateId, array|Arrayable|JsonSerializable $payload, ?string $aggregateType = null, ?int $version = null): string
    {
        $connection = $this->connection();
        if ($connection->transactionLevel() === 0) {
            throw OutsideTransactionException::forConnection($connection->getName());
        }
        $payload = $this->normalize($payload);
        $id = Uuid::v7();
        if ($sealer = $this->encryption->forTopic($topic)) {
            $payload = $sealer->sealPayload($id, $payload);
        }
        $connection->table($this->table)->insert([
            'id' => $id,
            'aggregate_type' => $aggregateType ?? (strstr($topic, '.', true) ?: $topic),
            'aggregate_id' => (string) $aggregateId,
            'topic' => $topic,
            'payload' => json_encode((object) $payload, self::JSON_FLAGS),
            'version' => $version,
            // DATETIME(6) in UTC, which is how outboxd reads it (--source-time-zone).
            'created_at' => (new DateTimeImmutable('now', new DateTimeZone('UTC')))->format('Y-m-d H:i:s.u'),
        ]);

        return $id;
    }

    /**
     * The blind index of `$value` for a sealed field of `$topic` (`[key id, hex]`, as `outboxd
     * keys blind-index` prints it): an equality search on a column that holds no clear value.
     */
    public function blindIndex(string $topic, string $field, string $value): array
    {
        $sealer = $this->encryption->forTopic($topic) ?? $this->encryption->keyring();

        return $sealer->blindIndex($field, $value);
    }

    public function encryption(): TopicEncryption
    {
        return $this->encryption;
    }

    public function connection(): ConnectionInterface
    {
        return $this->db->connection($this->connection);
    }

    public function table(): string
    {
        return $this->table;
    }

    private function normalize(array|Arrayable|JsonSerializable $payload): array
    {
        if ($payload instanceof Arrayable) {
            return $payload->toArray();
        }
        if ($payload instanceof JsonSerializable) {
            return json_decode(json_encode($payload, self::JSON_FLAGS), true, 512, JSON_THROW_ON_ERROR);
        }

        return $payload;
    }
}
