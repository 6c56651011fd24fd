<?php

namespace Outboxd\Laravel\Tests\Feature;

use Illuminate\Support\Facades\DB;
use Outboxd\Laravel\Console\ConsumeCommand;
use Outboxd\Laravel\Consumer\OutboxMessage;
use Outboxd\Laravel\Encryption\FieldCrypto;
use Outboxd\Laravel\Tests\TestCase;
use Outboxd\Laravel\Uuid;
use PhpAmqpLib\Channel\AMQPChannel;
use PhpAmqpLib\Connection\AMQPStreamConnection;
use PhpAmqpLib\Message\AMQPMessage;
use PhpAmqpLib\Wire\AMQPTable;
use Symfony\Component\Console\Input\ArrayInput;
use Symfony\Component\Console\Output\BufferedOutput;

/**
 * outbox:consume against RabbitMQ and MariaDB: the test publishes as outboxd does (message_id,
 * type, x-aggregate-* headers) to its own exchange.
 */
class ConsumeCommandTest extends TestCase
{
    private AMQPStreamConnection $amqp;

    private AMQPChannel $channel;

    private string $exchange;

    private string $queue;

    /** @var list<array{0: string, 1: array}> what the handler was given: message id, payload */
    public static array $handled = [];

    /** @var callable|null run by the handler before it records */
    public static $during = null;

    protected function outboxConfig(): array
    {
        $this->exchange = 'phpunit.'.bin2hex(random_bytes(4));
        $this->queue = $this->exchange.'.billing';

        return [
            'encryption' => ['keyring' => 'storage/keys.json', 'schemas' => 'resources/outbox'],
            'rabbitmq' => [
                'host' => getenv('OUTBOX_TEST_RABBITMQ_HOST'), 'port' => (int) getenv('OUTBOX_TEST_RABBITMQ_PORT'),
                'user' => 'guest', 'password' => 'guest', 'vhost' => '/', 'exchange' => $this->exchange,
            ],
            'consumers' => ['billing' => [
                'queue' => $this->queue,
                'bindings' => ['invoice.*'],
                'handlers' => ['invoice.*' => RecordingHandler::class],
            ]],
        ];
    }

    protected function setUp(): void
    {
        parent::setUp();
        $this->vectorKeyring();
        self::$handled = [];
        self::$during = null;
        try {
            $this->amqp = new AMQPStreamConnection(getenv('OUTBOX_TEST_RABBITMQ_HOST'), (int) getenv('OUTBOX_TEST_RABBITMQ_PORT'), 'guest', 'guest');
        } catch (\Throwable $e) {
            $this->fail("RabbitMQ at 127.0.0.1:5672 is not reachable ({$e->getMessage()}): start it with scripts/services.sh");
        }
        $this->channel = $this->amqp->channel();
        DB::statement('CREATE TABLE IF NOT EXISTS ledger (id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id CHAR(36) NOT NULL)');
        DB::table('ledger')->delete();
    }

    protected function tearDown(): void
    {
        foreach ([$this->queue, $this->queue.'.dead'] as $queue) {
            $this->channel->queue_delete($queue);
        }
        $this->channel->exchange_delete($this->exchange);
        $this->amqp->close();
        parent::tearDown();
    }

    private function declareExchange(): void
    {
        $this->channel->exchange_declare($this->exchange, 'topic', false, true, false);
    }

    /** Publishes as outboxd does; returns the message id. */
    private function publish(array $payload, ?int $version = null, ?string $id = null, string $topic = 'invoice.issued', ?string $table = null): string
    {
        $id ??= Uuid::v7();
        $headers = ['x-aggregate-type' => 'invoice', 'x-aggregate-id' => (string) ($payload['invoice_id'] ?? 1)];
        if ($version !== null) {
            $headers['x-aggregate-version'] = $version;
        }
        if ($table !== null) {
            $headers['x-outbox-table'] = $table;
        }
        $this->channel->basic_publish(new AMQPMessage(json_encode($payload), [
            'message_id' => $id,
            'type' => $topic,
            'content_type' => 'application/json',
            'delivery_mode' => AMQPMessage::DELIVERY_MODE_PERSISTENT,
            'application_headers' => new AMQPTable($headers),
        ]), $this->exchange, $topic);

        return $id;
    }

    /** @return array{0: int, 1: string} exit code and output */
    private function consume(array $options = []): array
    {
        $command = $this->app->make(ConsumeCommand::class);
        $command->setLaravel($this->app);
        $output = new BufferedOutput();
        $status = $command->run(new ArrayInput(['consumer' => 'billing', '--sleep' => 1, '--backoff' => 0] + $options), $output);

        return [$status, $output->fetch()];
    }

    private function ready(string $queue): int
    {
        [, $ready] = $this->channel->queue_declare($queue, true);

        return $ready;
    }

    private function declareQueue(): void
    {
        $this->declareExchange();
        $this->channel->queue_declare($this->queue, false, true, false, false);
        $this->channel->queue_bind($this->queue, $this->exchange, 'invoice.*');
    }

    public function test_a_redelivered_message_runs_its_handler_once(): void
    {
        $this->declareQueue();
        $id = $this->publish(['invoice_id' => 1, 'total_cents' => 100]);
        $this->publish(['invoice_id' => 1, 'total_cents' => 100], id: $id);
        $other = $this->publish(['invoice_id' => 2, 'total_cents' => 200]);

        [$status, $out] = $this->consume(['--stop-when-empty' => true]);

        $this->assertSame(0, $status, $out);
        $this->assertSame([$id, $other], array_column(self::$handled, 0));
        $this->assertSame(2, DB::table('ledger')->count());
        $this->assertSame(2, DB::table('processed_messages')->where('consumer', 'billing')->count());
        $this->assertSame(0, $this->ready($this->queue), 'every message acknowledged');
        $this->assertStringContainsString("Skipped (already processed, or stale) invoice.issued $id", $out);
        $this->assertStringContainsString("Processed invoice.issued $other", $this->logged(), 'logged through Laravel');
    }

    public function test_the_version_gate_drops_a_stale_version(): void
    {
        $this->declareQueue();
        $v2 = $this->publish(['invoice_id' => 5, 'total_cents' => 2], version: 2);
        $this->publish(['invoice_id' => 5, 'total_cents' => 1], version: 1);
        $v3 = $this->publish(['invoice_id' => 5, 'total_cents' => 3], version: 3);

        [$status, $out] = $this->consume(['--stop-when-empty' => true]);

        $this->assertSame(0, $status, $out);
        $this->assertSame([$v2, $v3], array_column(self::$handled, 0));
        $this->assertSame(3, DB::table('processed_messages')->count(), 'the stale message is claimed too');
        $this->assertSame(3, (int) DB::table('consumer_aggregate_versions')->where('aggregate_id', '5')->value('version'));
    }

    public function test_the_version_gate_tells_outbox_tables_apart(): void
    {
        $this->declareQueue();
        $a9 = $this->publish(['invoice_id' => 7, 'total_cents' => 9], version: 9, table: 'outbox');
        $b1 = $this->publish(['invoice_id' => 7, 'total_cents' => 1], version: 1, table: 'billing_outbox');
        $b2 = $this->publish(['invoice_id' => 7, 'total_cents' => 2], version: 2, table: 'billing_outbox');

        [$status, $out] = $this->consume(['--stop-when-empty' => true]);

        $this->assertSame(0, $status, $out);
        $this->assertSame([$a9, $b1, $b2], array_column(self::$handled, 0), 'aggregate 7 of billing_outbox is not stale after aggregate 7 of outbox');
        $this->assertSame(2, DB::table('consumer_aggregate_versions')->where('aggregate_id', '7')->count());
    }

    public function test_sealed_fields_reach_the_handler_opened(): void
    {
        $this->declareQueue();
        $v = json_decode(file_get_contents(static::vectorsDir().'/vectors.json'), true);
        $this->publish($v['sealed'], id: $v['event_id']);

        [$status, $out] = $this->consume(['--stop-when-empty' => true]);

        $this->assertSame(0, $status, $out);
        $this->assertSame([[$v['event_id'], $v['payload']]], self::$handled);
        $this->assertStringNotContainsString('Ayşe', $out.$this->logged());
    }

    public function test_a_key_the_ring_lacks_stops_the_worker_and_leaves_the_message_queued(): void
    {
        $this->declareQueue();
        $other = FieldCrypto::fromJson(json_encode(['outboxd_keyring' => 1, 'current' => 'k0ther', 'keys' => [
            ['id' => 'k0ther', 'key' => rtrim(strtr(base64_encode(random_bytes(32)), '+/', '-_'), '=')],
        ]]));
        $other->useSchema(['invoice_id' => ['x-gdpr-sensitive' => false], 'customer_name' => ['x-gdpr-sensitive' => true]]);
        $id = Uuid::v7();
        $this->publish($other->sealPayload($id, ['invoice_id' => 9, 'customer_name' => 'Ayşe']), id: $id);
        $after = $this->publish(['invoice_id' => 10]);

        [$status, $out] = $this->consume(['--stop-when-empty' => true]);

        $this->assertSame(1, $status, $out);
        $this->assertStringContainsString("Stopped on message $id", $out);
        $this->assertStringContainsString('UnknownKeyId', $out);
        $this->assertStringContainsString("fix: copy the producer's current key ring", $out);
        $this->assertSame([], self::$handled, 'nothing after the message it could not open');
        $this->assertSame(2, $this->ready($this->queue), 'both messages still queued');
        $this->assertSame(0, $this->ready($this->queue.'.dead'), 'nothing dead-lettered');
        $this->assertSame(0, DB::table('processed_messages')->count());
        unset($after);
    }

    public function test_a_tampered_value_goes_to_the_dead_letter_queue_with_the_reason(): void
    {
        $this->declareQueue();
        $v = json_decode(file_get_contents(static::vectorsDir().'/vectors.json'), true);
        $this->publish($v['sealed'], id: Uuid::v7());   // copied to another event id

        [$status, $out] = $this->consume(['--stop-when-empty' => true]);

        $this->assertSame(0, $status, $out);
        $this->assertSame([], self::$handled);
        $this->assertSame(1, $this->ready($this->queue.'.dead'));
        $dead = $this->channel->basic_get($this->queue.'.dead', true);
        $this->assertStringStartsWith('WrongEvent: ', $dead->get('application_headers')->getNativeData()['x-outboxd-error']);
    }

    public function test_it_waits_for_the_relay_to_declare_the_exchange(): void
    {
        [$status, $out] = $this->consume(['--max-time' => 2]);

        $this->assertSame(0, $status, $out);
        $this->assertStringContainsString("Waiting for the exchange {$this->exchange}: outboxd declares it", $out);
        $this->assertStringContainsString('Stopping: ran 2s (--max-time)', $out);
        $this->assertSame(1, substr_count($out, 'Waiting for the exchange'), 'said once, not every check');
    }

    public function test_max_jobs_stops_after_that_many_messages(): void
    {
        $this->declareQueue();
        foreach ([1, 2, 3] as $n) {
            $this->publish(['invoice_id' => $n]);
        }

        [$status, $out] = $this->consume(['--max-jobs' => 2]);

        $this->assertSame(0, $status, $out);
        $this->assertCount(2, self::$handled);
        $this->assertStringContainsString('Stopping: 2 messages processed (--max-jobs)', $out);
        $this->assertSame(1, $this->ready($this->queue), 'the third stays queued (the prefetched one is handed back)');
    }

    public function test_sigterm_lets_the_message_in_hand_finish_then_stops(): void
    {
        $this->declareQueue();
        $first = $this->publish(['invoice_id' => 1]);
        $this->publish(['invoice_id' => 2]);
        self::$during = fn () => posix_kill(getmypid(), SIGTERM);

        [$status, $out] = $this->consume();

        $this->assertSame(0, $status, $out);
        $this->assertSame([$first], array_column(self::$handled, 0));
        $this->assertSame(1, DB::table('ledger')->count(), 'the message in hand was committed');
        $this->assertStringContainsString('Stopping: signal received', $out);
        $this->assertSame(1, $this->ready($this->queue), 'the second is back in the queue');
    }

    public function test_a_failing_handler_is_retried_then_dead_lettered(): void
    {
        $this->declareQueue();
        $id = $this->publish(['invoice_id' => 1, 'fail' => true]);

        [$status, $out] = $this->consume(['--stop-when-empty' => true, '--tries' => 2]);

        $this->assertSame(0, $status, $out);
        $this->assertStringContainsString("Attempt 1 of 2 at invoice.issued $id failed", $out);
        $this->assertSame(1, $this->ready($this->queue.'.dead'));
        $this->assertSame(0, DB::table('ledger')->count(), 'the failed attempts left nothing');
        $this->assertSame(0, DB::table('processed_messages')->count(), 'nor a claim');
    }

    public function test_a_lost_database_connection_is_waited_out_and_the_message_kept(): void
    {
        $this->declareQueue();
        $id = $this->publish(['invoice_id' => 1]);
        $killed = false;
        self::$during = function () use (&$killed) {
            if (! $killed) {
                $killed = true;
                // Another session kills this one's connection: the transaction is gone.
                $this->pdo()->exec('KILL '.(int) DB::selectOne('SELECT CONNECTION_ID() AS id')->id);
            }
        };

        [$status, $out] = $this->consume(['--stop-when-empty' => true, '--tries' => 1]);

        $this->assertSame(0, $status, $out);
        $this->assertTrue($killed, 'the connection was killed');
        $this->assertStringContainsString('Database connection lost', $out);
        $this->assertSame(1, DB::table('ledger')->where('message_id', $id)->count(), 'applied once after the reconnect');
        $this->assertSame(0, $this->ready($this->queue.'.dead'), 'not dead-lettered although --tries=1');
    }
}

/** The handler the tests configure: records what it was given, and fails when told to. */
class RecordingHandler
{
    public function handle(OutboxMessage $message): void
    {
        if (ConsumeCommandTest::$during) {
            (ConsumeCommandTest::$during)();
        }
        if ($message->get('fail')) {
            throw new \RuntimeException('the handler failed');
        }
        DB::table('ledger')->insert(['message_id' => $message->id]);
        ConsumeCommandTest::$handled[] = [$message->id, $message->payload];
    }
}
