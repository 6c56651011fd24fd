<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Consumer;

use Closure;
use Illuminate\Contracts\Container\Container;
use Illuminate\Database\Connection;
use Illuminate\Database\DetectsLostConnections;
use Illuminate\Database\QueryException;
use Illuminate\Support\Str;
use Outboxd\Laravel\Encryption\CryptoException;
use Outboxd\Laravel\Encryption\TopicEncryption;
use Outboxd\Laravel\Exceptions\PoisonMessage;
use Outboxd\Laravel\Uuid;
use PhpAmqpLib\Channel\AMQPChannel;
use PhpAmqpLib\Connection\AMQPStreamConnection;
use PhpAmqpLib\Exception\AMQPProtocolChannelException;
use PhpAmqpLib\Exception\AMQPTimeoutException;
use PhpAmqpLib\Message\AMQPMessage;
use PhpAmqpLib\Wire\AMQPTable;
use Psr\Log\LoggerInterface;
use Throwable;

/**
 * The loop behind outbox:consume, in the manner of Illuminate\Queue\Worker: it takes outboxd's
 * messages from a RabbitMQ queue with manual acknowledgements and applies each through the
 * Inbox (claim, stale gate and handler in one database transaction), acknowledging only after
 * the commit.
 *
 * It waits rather than dies: for the exchange until the relay has declared it, for the broker
 * and the database while they are away (the message in hand is kept and retried). It stops on
 * SIGTERM/SIGINT after the message in hand, on --max-jobs, --max-time, --memory and
 * --stop-when-empty, and on a message sealed with a key its key ring lacks: that one stays in
 * the queue (no retry, nor the dead-letter queue, can fix a missing key).
 */
class Worker
{
    use DetectsLostConnections;

    public const EXIT_SUCCESS = 0;

    public const EXIT_ERROR = 1;

    public const EXIT_MEMORY_LIMIT = 12;

    public bool $shouldQuit = false;

    private ?AMQPStreamConnection $amqp = null;

    private ?AMQPChannel $channel = null;

    private ?AMQPChannel $publisher = null;

    private Inbox $inbox;

    private ?int $exitCode = null;

    private int $jobs = 0;

    private bool $waitingLogged = false;

    /**
     * @param  array{host:string,port:int,user:string,password:string,vhost:string}  $rabbitmq
     * @param  array<string, class-string>  $handlers  topic (wildcards allowed) => handler class
     * @param  list<string>  $bindings  the queue's binding keys on the exchange
     * @param  Closure(string $level, string $message): void|null  $output  the console's echo of each log line
     */
    public function __construct(
        private readonly Container $container,
        private readonly Connection $db,
        private readonly TopicEncryption $encryption,
        private readonly LoggerInterface $log,
        private readonly array $rabbitmq,
        private readonly string $name,
        private readonly string $exchange,
        private readonly string $queue,
        private readonly array $bindings,
        private readonly array $handlers,
        private readonly ?Closure $output = null,
    ) {
        $this->inbox = new Inbox($db, $name);
    }

    /** Consumes until a limit, a signal or a missing key stops it; returns the exit code. */
    public function run(WorkerOptions $options): int
    {
        $this->listenForSignals();
        $started = microtime(true);
        while ($this->exitCode === null) {
            if ($this->shouldQuit) {
                $this->stop(self::EXIT_SUCCESS, 'info', 'Stopping: signal received');
                break;
            }
            if ($this->ready($options)) {
                try {
                    $this->channel->wait(null, false, 1.0);
                } catch (AMQPTimeoutException) {
                    if ($options->stopWhenEmpty && $this->queueIsEmpty()) {
                        $this->stop(self::EXIT_SUCCESS, 'info', "Stopping: {$this->queue} is empty");
                    }
                } catch (Throwable $e) {
                    if (! $this->shouldQuit) {
                        $this->brokerLost($e, $options);
                    }
                }
            }
            $this->stopIfLimitReached($options, $started);
        }
        $this->disconnect();

        return $this->exitCode;
    }

    /**
     * Declares the queue, its bindings and `<queue>.dead`, waiting up to `$timeout` seconds for
     * the relay's exchange; returns whether it did.
     */
    public function declare(WorkerOptions $options, int $timeout): bool
    {
        $this->listenForSignals();
        $deadline = microtime(true) + $timeout;
        while (! $this->shouldQuit && microtime(true) < $deadline) {
            try {
                $this->connect();
                if ($this->declareTopology()) {
                    $this->disconnect();

                    return true;
                }
            } catch (Throwable $e) {
                $this->log('warning', "RabbitMQ unreachable: {$e->getMessage()}");
            }
            $this->disconnect();
            $this->pause(min($options->sleep, max(0, $deadline - microtime(true))));
        }

        return false;
    }

    private function ready(WorkerOptions $options): bool
    {
        if ($this->channel !== null) {
            return true;
        }
        try {
            $this->connect();
            if (! $this->declareTopology()) {
                $this->disconnect();
                $this->pause($options->sleep);

                return false;
            }
            $this->channel->basic_qos(0, $options->prefetch, false);
            $this->channel->basic_consume($this->queue, '', false, false, false, false, function (AMQPMessage $message) use ($options): void {
                $this->handle($message, $options);
            });
            $this->log('info', "Consuming {$this->queue} (exchange {$this->exchange}) as {$this->name}");

            return true;
        } catch (Throwable $e) {
            $this->brokerLost($e, $options);

            return false;
        }
    }

    private function connect(): void
    {
        $r = $this->rabbitmq;
        $this->amqp = new AMQPStreamConnection(
            $r['host'], (int) $r['port'], $r['user'], $r['password'], $r['vhost'] ?? '/',
            false, 'AMQPLAIN', null, 'en_US', 3.0, 30.0,
        );
        $this->channel = $this->amqp->channel();
        // Dead-letter publishes are confirmed on their own channel, apart from the deliveries.
        $this->publisher = $this->amqp->channel();
        $this->publisher->confirm_select();
    }

    /** False while the relay has not declared the exchange yet. */
    private function declareTopology(): bool
    {
        try {
            // outboxd declares the exchange (with its alternate exchange): only check it here.
            $this->channel->exchange_declare($this->exchange, 'topic', true);
        } catch (AMQPProtocolChannelException $e) {
            if ($e->getCode() !== 404) {
                throw $e;
            }
            if (! $this->waitingLogged) {
                $this->log('warning', "Waiting for the exchange {$this->exchange}: outboxd declares it when it starts (outboxd run --exchange {$this->exchange})");
                $this->waitingLogged = true;
            }

            return false;
        }
        if ($this->waitingLogged) {
            $this->log('info', "The exchange {$this->exchange} is there");
            $this->waitingLogged = false;
        }
        $this->channel->queue_declare($this->queue, false, true, false, false);
        foreach ($this->bindings as $key) {
            $this->channel->queue_bind($this->queue, $this->exchange, $key);
        }
        $this->channel->queue_declare($this->queue.'.dead', false, true, false, false);

        return true;
    }

    private function handle(AMQPMessage $delivery, WorkerOptions $options): void
    {
        try {
            $message = $this->decode($delivery);
            $ran = $this->process($message, $options);
            $delivery->ack();
            $this->jobs++;
            $this->log('info', ($ran ? 'Processed' : 'Skipped (already processed, or stale)')." {$message->topic} {$message->id}");
        } catch (PoisonMessage $poison) {
            $this->deadLetter($delivery, $poison->getMessage());
            $delivery->ack();
            $this->jobs++;
        } catch (CryptoException $missing) {
            // Only a missing key gets here (decode turns the others into poison): the message
            // goes back to the queue, and the worker stops until its key ring is updated.
            $delivery->nack(true);
            $path = $this->encryption->keyringPath() ?? 'the path OUTBOX_KEYRING names';
            $this->stop(self::EXIT_ERROR, 'error', "Stopped on message {$this->messageId($delivery)}, left in {$this->queue}: {$missing->kind}: {$missing->getMessage()}\n  fix: copy the producer's current key ring (the file outboxd keys rotate updated) to {$path}, then start outbox:consume again");
        } catch (StopRequested) {
            $delivery->nack(true);
        }
    }

    /** The message as a handler sees it; poison when it cannot be read. */
    private function decode(AMQPMessage $delivery): OutboxMessage
    {
        $id = $this->messageId($delivery);
        if (! Uuid::isValid($id)) {
            throw new PoisonMessage("message_id \"$id\" is not a UUID");
        }
        $headers = $delivery->has('application_headers') ? $delivery->get('application_headers')->getNativeData() : [];
        $topic = $delivery->has('type') ? (string) $delivery->get('type') : (string) $delivery->getRoutingKey();
        try {
            $payload = json_decode($delivery->getBody(), true, 512, JSON_THROW_ON_ERROR);
        } catch (\JsonException $e) {
            throw new PoisonMessage('the body is not JSON: '.$e->getMessage());
        }
        if (! is_array($payload)) {
            throw new PoisonMessage('the body is not a JSON object');
        }
        try {
            $payload = $this->encryption->open($id, $payload);
        } catch (CryptoException $e) {
            if ($e->isMissingKey()) {
                throw $e;
            }
            throw new PoisonMessage("{$e->kind}: {$e->getMessage()}");
        }

        return new OutboxMessage($id, $topic, $payload, $headers);
    }

    /**
     * Applies the message through the Inbox. A lost database connection is waited out and the
     * same message tried again (not counted); any other failure is retried --tries times, then
     * the message is poison.
     */
    private function process(OutboxMessage $message, WorkerOptions $options): bool
    {
        $handler = $this->handlerFor($message->topic)
            ?? throw new PoisonMessage("no handler for topic {$message->topic} in outbox.consumers.{$this->name}.handlers");
        $attempts = 0;
        $outage = 0;
        while (true) {
            try {
                return $this->inbox->process($message, function () use ($handler, $message): void {
                    $this->container->call([$this->container->make($handler), 'handle'], ['message' => $message]);
                });
            } catch (PoisonMessage $poison) {
                throw $poison;
            } catch (Throwable $e) {
                if ($this->lostConnection($e)) {
                    $wait = min(30, 2 ** min($outage++, 5));
                    $this->log('warning', "Database connection lost ({$this->describe($e)}); message {$message->id} kept, trying again in {$wait}s");
                    $this->pause($wait);
                } elseif (++$attempts >= $options->tries) {
                    throw new PoisonMessage("failed {$attempts} times: {$this->describe($e)}", 0, $e);
                } else {
                    $this->log('warning', "Attempt {$attempts} of {$options->tries} at {$message->topic} {$message->id} failed: {$this->describe($e)}; retrying in {$options->backoff}s");
                    $this->pause($options->backoff);
                }
            }
            if ($this->shouldQuit) {
                throw new StopRequested();
            }
            if ($outage > 0) {
                try {
                    $this->db->reconnect();
                } catch (Throwable) {
                    // still down: the next attempt says so and waits again
                }
            }
        }
    }

    private function lostConnection(Throwable $e): bool
    {
        for (; $e !== null; $e = $e->getPrevious()) {
            if ($this->causedByLostConnection($e)) {
                return true;
            }
        }

        return false;
    }

    /**
     * An error for logs and the dead-letter header. A database error's message can quote the
     * row's values, which may be personal data opened from sealed fields: only its code goes.
     */
    private function describe(Throwable $e): string
    {
        if ($e instanceof QueryException || $e instanceof \PDOException) {
            $info = $e->errorInfo ?? [];

            return class_basename($e).' SQLSTATE['.($info[0] ?? $e->getCode()).']'.(isset($info[1]) ? " error {$info[1]}" : '');
        }

        return class_basename($e).': '.$e->getMessage();
    }

    private function handlerFor(string $topic): ?string
    {
        foreach ($this->handlers as $pattern => $handler) {
            if ($pattern === $topic || Str::is($pattern, $topic)) {
                return $handler;
            }
        }

        return null;
    }

    private function deadLetter(AMQPMessage $delivery, string $reason): void
    {
        $properties = $delivery->get_properties();
        $headers = isset($properties['application_headers']) ? $properties['application_headers']->getNativeData() : [];
        $headers['x-outboxd-error'] = $reason;
        $headers['x-outboxd-consumer'] = $this->name;
        $properties['application_headers'] = new AMQPTable($headers);
        $properties['delivery_mode'] = AMQPMessage::DELIVERY_MODE_PERSISTENT;
        $this->publisher->basic_publish(new AMQPMessage($delivery->getBody(), $properties), '', $this->queue.'.dead', true);
        $this->publisher->wait_for_pending_acks_returns(30);
        $this->log('error', "Dead-lettered {$this->messageId($delivery)} to {$this->queue}.dead: {$reason}");
    }

    private function queueIsEmpty(): bool
    {
        [, $ready] = $this->publisher->queue_declare($this->queue, true);

        return $ready === 0;
    }

    private function brokerLost(Throwable $e, WorkerOptions $options): void
    {
        $this->log('warning', "RabbitMQ connection lost or unreachable ({$e->getMessage()}); reconnecting in {$options->sleep}s");
        $this->disconnect();
        $this->pause($options->sleep);
    }

    private function stopIfLimitReached(WorkerOptions $options, float $started): void
    {
        if ($this->exitCode !== null) {
            return;
        }
        if ($options->maxJobs > 0 && $this->jobs >= $options->maxJobs) {
            $this->stop(self::EXIT_SUCCESS, 'info', "Stopping: {$this->jobs} messages processed (--max-jobs)");
        } elseif ($options->maxTime > 0 && microtime(true) - $started >= $options->maxTime) {
            $this->stop(self::EXIT_SUCCESS, 'info', "Stopping: ran {$options->maxTime}s (--max-time)");
        } elseif (memory_get_usage(true) / 1024 / 1024 >= $options->memory) {
            $this->stop(self::EXIT_MEMORY_LIMIT, 'warning', "Stopping: memory limit of {$options->memory}MB reached (--memory)");
        }
    }

    private function stop(int $code, string $level, string $message): void
    {
        $this->exitCode = $code;
        $this->log($level, $message);
    }

    /** Closing the channel hands the messages taken ahead and not acknowledged back to the queue. */
    private function disconnect(): void
    {
        foreach ([$this->channel, $this->publisher] as $channel) {
            try {
                $channel?->close();
            } catch (Throwable) {
            }
        }
        try {
            $this->amqp?->close();
        } catch (Throwable) {
        }
        $this->channel = $this->publisher = $this->amqp = null;
    }

    /** Sleeps `$seconds`, returning early on a stop signal. */
    private function pause(float $seconds): void
    {
        $until = microtime(true) + $seconds;
        while (! $this->shouldQuit && microtime(true) < $until) {
            usleep((int) (min(0.1, $until - microtime(true)) * 1e6));
        }
    }

    private function listenForSignals(): void
    {
        if (! extension_loaded('pcntl')) {
            return;
        }
        pcntl_async_signals(true);
        foreach ([SIGTERM, SIGINT, SIGQUIT] as $signal) {
            pcntl_signal($signal, function (): void {
                $this->shouldQuit = true;
            });
        }
    }

    private function messageId(AMQPMessage $delivery): string
    {
        return $delivery->has('message_id') ? (string) $delivery->get('message_id') : '';
    }

    private function log(string $level, string $message): void
    {
        $this->log->log($level, "outbox:consume {$this->name}: $message");
        if ($this->output !== null) {
            ($this->output)($level, $message);
        }
    }
}
