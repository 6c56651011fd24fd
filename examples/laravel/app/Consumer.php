<?php
// The idempotent consumer: php-amqplib with manual acks. Each message is claimed in
// `processed_messages` (insertOrIgnore of its message_id) in the same database transaction as
// its effect, and acknowledged only after that transaction commits. A redelivery after a crash
// finds its claim and does nothing; a crash before the commit leaves no claim and no effect, so
// the redelivery applies it. That makes the effect exactly-once on top of at-least-once delivery.
// A per-aggregate version gate drops stale events; a message that can never be applied goes to
// `<queue>.dead` with the reason; `outboxd prune` trims processed_messages.

declare(strict_types=1);

namespace App;

use DB;
use PhpAmqpLib\Channel\AMQPChannel;
use PhpAmqpLib\Connection\AMQPStreamConnection;
use PhpAmqpLib\Message\AMQPMessage;
use PhpAmqpLib\Wire\AMQPTable;

/** A message that no retry can apply: it goes to the dead-letter queue. */
final class Poison extends \RuntimeException
{
}

final class Consumer
{
    private AMQPChannel $channel;

    /** @param callable(array $payload, string $eventId, AMQPMessage $m): void $effect */
    public function __construct(
        private readonly AMQPStreamConnection $conn,
        private readonly string $name,
        private readonly string $queue,
        private readonly ?FieldCrypto $crypto,
        private $effect,
    ) {
        $this->channel = $conn->channel();
    }

    /** Declares the queue (durable) bound to `$exchange` by `$pattern`, and `<queue>.dead`. */
    public function declare(string $exchange, string $pattern): void
    {
        try {
            // outboxd declares the exchange (with its alternate exchange); only check it here.
            $this->channel->exchange_declare($exchange, 'topic', true);
        } catch (\PhpAmqpLib\Exception\AMQPProtocolChannelException $e) {
            throw new \RuntimeException("exchange $exchange does not exist: start outboxd first (it declares it), or pass the exchange it uses ({$e->getMessage()})");
        }
        $this->channel = $this->conn->channel();
        $this->channel->queue_declare($this->queue, false, true, false, false);
        $this->channel->queue_bind($this->queue, $exchange, $pattern);
        $this->channel->queue_declare($this->queue . '.dead', false, true, false, false);
    }

    /**
     * Consumes until stopped; with `$untilEmpty`, returns once a second passes without a
     * delivery and the queue holds no ready message (every message this consumer took has been
     * handled by then: the callback runs to its ack before the next wait).
     */
    public function run(int $prefetch = 20, bool $untilEmpty = false): void
    {
        $this->channel->confirm_select(); // for the dead-letter publishes
        $this->channel->basic_qos(0, $prefetch, false);
        $this->channel->basic_consume($this->queue, '', false, false, false, false, function (AMQPMessage $m): void {
            $this->handle($m);
        });
        while ($this->channel->is_consuming()) {
            try {
                $this->channel->wait(null, false, $untilEmpty ? 1.0 : 0);
            } catch (\PhpAmqpLib\Exception\AMQPTimeoutException) {
                [, $ready] = $this->conn->channel()->queue_declare($this->queue, true);
                if ($ready === 0) {
                    return;
                }
            }
        }
    }

    private function handle(AMQPMessage $m): void
    {
        try {
            $id = $m->has('message_id') ? (string) $m->get('message_id') : '';
            if (!preg_match('/^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i', $id)) {
                throw new Poison("message_id \"$id\" is not a UUID");
            }
            $headers = $m->has('application_headers') ? $m->get('application_headers')->getNativeData() : [];
            try {
                $payload = json_decode($m->getBody(), true, 512, JSON_THROW_ON_ERROR);
            } catch (\JsonException $e) {
                throw new Poison('the body is not JSON: ' . $e->getMessage());
            }
            if (!is_array($payload)) {
                throw new Poison('the body is not a JSON object');
            }
            if ($this->crypto !== null) {
                try {
                    $payload = $this->crypto->openPayload($id, $payload);
                } catch (CryptoError $e) {
                    throw new Poison($e->kind . ': ' . $e->getMessage());
                }
            }
            DB::transaction(function () use ($id, $headers, $payload, $m): void {
                if (!$this->claim($id)) {
                    return; // a redelivery: its effect is already committed
                }
                if (!$this->newer($headers)) {
                    return; // stale: a newer version of the aggregate was applied
                }
                ($this->effect)($payload, $id, $m);
            });
            $m->ack();
        } catch (Poison $p) {
            $this->deadLetter($m, $p->getMessage());
            $m->ack();
        }
        // Anything else (database down, deadlock, lost connection) ends the process with the
        // message unacknowledged: the broker delivers it again, and the claim decides.
    }

    /** The claim: true when this message id is new for this consumer. */
    private function claim(string $id): bool
    {
        $inserted = DB::table('processed_messages')->insertOrIgnore([
            'consumer' => $this->name,
            'message_id' => FieldCrypto::uuidBytes($id),
        ]);
        if ($inserted === 1) {
            return true;
        }
        // INSERT IGNORE also turns errors (truncation, …) into warnings: only a duplicate key
        // (1062) means "already processed".
        foreach (DB::select('SHOW WARNINGS') as $w) {
            if ((int) $w->Code !== 1062) {
                throw new \RuntimeException("processed_messages claim: {$w->Level} {$w->Code}: {$w->Message}");
            }
        }
        return false;
    }

    /**
     * The stale gate: with `x-aggregate-version`, record it as the aggregate's last applied
     * version when it is newer, and say whether it was (the upsert locks the aggregate's row, so
     * two messages of one aggregate are decided one after the other).
     */
    private function newer(array $headers): bool
    {
        if (!isset($headers['x-aggregate-version'], $headers['x-aggregate-id'])) {
            return true;
        }
        $affected = DB::affectingStatement(
            'INSERT INTO consumer_aggregate_versions (consumer, aggregate_type, aggregate_id, version) VALUES (?, ?, ?, ?)
             ON DUPLICATE KEY UPDATE updated_at = IF(VALUES(version) > version, CURRENT_TIMESTAMP(6), updated_at), version = GREATEST(version, VALUES(version))',
            [$this->name, (string) ($headers['x-aggregate-type'] ?? ''), (string) $headers['x-aggregate-id'], (int) $headers['x-aggregate-version']]
        );
        // 1 = first version of the aggregate, 2 = a newer one replaced the last; 0 = not newer.
        return $affected > 0;
    }

    private function deadLetter(AMQPMessage $m, string $reason): void
    {
        fwrite(STDERR, "dead-lettered " . ($m->has('message_id') ? $m->get('message_id') : '?') . ": $reason\n");
        $props = $m->get_properties();
        $headers = isset($props['application_headers']) ? $props['application_headers']->getNativeData() : [];
        $headers['x-outboxd-error'] = $reason;
        $headers['x-outboxd-consumer'] = $this->name;
        $props['application_headers'] = new AMQPTable($headers);
        $props['delivery_mode'] = AMQPMessage::DELIVERY_MODE_PERSISTENT;
        $this->channel->basic_publish(new AMQPMessage($m->getBody(), $props), '', $this->queue . '.dead', true);
        $this->channel->wait_for_pending_acks_returns(30);
    }
}
