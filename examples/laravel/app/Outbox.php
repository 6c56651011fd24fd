<?php
// The producer's half of the transactional outbox: `Outbox::write($topic, $aggregateId,
// $payload)` inserts one row into the outbox table on the current database connection, so it
// commits or rolls back with the business rows of the surrounding `DB::transaction`. outboxd
// relays the committed rows (binlog or poll mode); this class never talks to the broker.

declare(strict_types=1);

namespace App;

use Illuminate\Database\Capsule\Manager as DB;

final class Outbox
{
    private static ?FieldCrypto $crypto = null;
    private static string $table = 'outbox';

    /** Seal the schema's `x-gdpr-sensitive` fields of every payload before it is written. */
    public static function encryptWith(?FieldCrypto $crypto): void
    {
        self::$crypto = $crypto;
    }

    public static function useTable(string $table): void
    {
        self::$table = $table;
    }

    /**
     * Writes one event; returns its id (a UUID v7, which is also the message's `message_id` and
     * the consumer's idempotency key). Call it inside `DB::transaction`: outside one the row
     * would commit on its own, which is exactly the dual write the outbox exists to avoid.
     */
    public static function write(string $topic, string|int $aggregateId, array $payload, string $aggregateType = 'invoice', ?int $version = null): string
    {
        if (DB::connection()->transactionLevel() === 0) {
            throw new \LogicException('Outbox::write outside DB::transaction: the event would commit apart from the business rows; wrap both in DB::transaction(function () { … })');
        }
        $id = self::uuid7();
        if (self::$crypto !== null) {
            $payload = self::$crypto->sealPayload($id, $payload);
        }
        DB::table(self::$table)->insert([
            'id' => FieldCrypto::uuidBytes($id),
            'aggregate_type' => $aggregateType,
            'aggregate_id' => (string) $aggregateId,
            'event_type' => $topic,
            'payload' => json_encode($payload, JSON_UNESCAPED_SLASHES | JSON_UNESCAPED_UNICODE | JSON_PRESERVE_ZERO_FRACTION | JSON_THROW_ON_ERROR),
            'version' => $version,
            'created_at' => self::now(),
        ]);
        return $id;
    }

    /** UTC with microseconds: the column is DATETIME(6), read by outboxd as UTC. */
    private static function now(): string
    {
        return (new \DateTimeImmutable('now', new \DateTimeZone('UTC')))->format('Y-m-d H:i:s.u');
    }

    /**
     * RFC 9562 UUID v7: 48 bits of Unix milliseconds, then random bits. Ids rise with time, so
     * the primary key (BINARY(16)) grows at its end like an auto-increment does, and poll mode's
     * tie-break on `id` follows the insert order within a process (a counter in the random bits
     * keeps that true within one millisecond).
     */
    public static function uuid7(): string
    {
        static $lastMs = 0, $counter = 0;
        $ms = (int) floor(microtime(true) * 1000);
        if ($ms <= $lastMs) {
            $ms = $lastMs;
            $counter++;
        } else {
            $lastMs = $ms;
            $counter = random_int(0, 0x3ff);
        }
        $bytes = substr(pack('J', $ms), 2, 6)                     // 48-bit timestamp
            . pack('n', 0x7000 | ($counter & 0x0fff))              // version 7, 12-bit counter
            . chr(0x80 | random_int(0, 0x3f)) . random_bytes(7);   // variant 10, random
        $h = bin2hex($bytes);
        return substr($h, 0, 8) . '-' . substr($h, 8, 4) . '-' . substr($h, 12, 4) . '-' . substr($h, 16, 4) . '-' . substr($h, 20);
    }
}
