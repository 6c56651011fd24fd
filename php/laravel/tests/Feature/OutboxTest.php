<?php

namespace Outboxd\Laravel\Tests\Feature;

use Illuminate\Support\Facades\DB;
use Outboxd\Laravel\Exceptions\OutsideTransactionException;
use Outboxd\Laravel\Facades\Outbox;
use Outboxd\Laravel\Outbox as OutboxService;
use Outboxd\Laravel\Tests\TestCase;

class OutboxTest extends TestCase
{
    public function test_the_provider_registers_the_facade_config_and_commands(): void
    {
        $this->assertInstanceOf(OutboxService::class, Outbox::getFacadeRoot());
        $this->assertSame($this->app->make(OutboxService::class), $this->app->make('outbox'));
        $this->assertSame('outbox', config('outbox.table'));
        $this->assertSame('cdc', config('outbox.relay.mode'));
        $commands = array_map(fn ($c) => (new $c)->getName(), $this->registeredCommands());
        $this->assertEqualsCanonicalizing(
            ['outbox:consume', 'outbox:declare', 'outbox:prune', 'outbox:keys', 'outbox:encrypt', 'outbox:decrypt'],
            $commands,
        );
        $published = \Illuminate\Support\ServiceProvider::pathsToPublish(\Outboxd\Laravel\OutboxServiceProvider::class, 'outbox-config');
        $this->assertSame([$this->basePath.'/config/outbox.php'], array_values($published));
    }

    public function test_write_inside_a_transaction_inserts_the_event_with_a_uuid_v7_id(): void
    {
        $id = DB::transaction(fn () => Outbox::write('order.placed', 42, ['order_id' => 42, 'total' => 9.5], version: 3));

        $this->assertMatchesRegularExpression('/^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/', $id);
        $row = DB::table('outbox')->where('id', $id)->first();
        $this->assertNotNull($row);
        $this->assertSame('order.placed', $row->topic);
        $this->assertSame('order', $row->aggregate_type);
        $this->assertSame('42', $row->aggregate_id);
        $this->assertSame(3, (int) $row->version);
        $this->assertSame('pending', $row->status);
        $this->assertSame(['order_id' => 42, 'total' => 9.5], json_decode($row->payload, true));
    }

    public function test_ids_rise_in_insert_order(): void
    {
        $ids = DB::transaction(fn () => array_map(fn ($n) => Outbox::write('order.placed', $n, ['n' => $n]), range(1, 50)));

        $sorted = $ids;
        sort($sorted);
        $this->assertSame($ids, $sorted);
        $this->assertCount(50, array_unique($ids));
    }

    public function test_a_rollback_takes_the_event_with_it(): void
    {
        try {
            DB::transaction(function () {
                Outbox::write('order.placed', 7, ['order_id' => 7]);
                throw new \RuntimeException('the business write failed');
            });
            $this->fail('the transaction did not throw');
        } catch (\RuntimeException $e) {
            $this->assertSame('the business write failed', $e->getMessage());
        }

        $this->assertSame(0, DB::table('outbox')->count());
    }

    public function test_write_outside_a_transaction_is_refused_and_writes_nothing(): void
    {
        try {
            Outbox::write('order.placed', 1, ['order_id' => 1]);
            $this->fail('Outbox::write outside a transaction did not throw');
        } catch (OutsideTransactionException $e) {
            $this->assertStringContainsString('DB::transaction', $e->getMessage());
        }

        $this->assertSame(0, DB::table('outbox')->count());
    }

    public function test_a_transaction_on_another_connection_does_not_count(): void
    {
        config(['database.connections.other' => config('database.connections.mysql')]);

        $this->expectException(OutsideTransactionException::class);
        DB::connection('other')->transaction(fn () => Outbox::write('order.placed', 1, ['order_id' => 1]));
    }

    /** @return list<class-string> the outbox:* commands artisan lists */
    private function registeredCommands(): array
    {
        $artisan = new \Illuminate\Console\Application($this->app, $this->app['events'], 'test');
        $names = array_filter(array_keys($artisan->all()), fn ($name) => str_starts_with($name, 'outbox:'));

        return array_values(array_map(fn ($name) => get_class($artisan->get($name)), $names));
    }
}
