<?php

namespace Outboxd\Laravel\Tests\Feature;

use Illuminate\Support\Facades\DB;
use Outboxd\Laravel\Encryption\CryptoException;
use Outboxd\Laravel\Encryption\TopicEncryption;
use Outboxd\Laravel\Facades\Outbox;
use Outboxd\Laravel\Tests\TestCase;

/** Outbox::write with encryption configured: sealed per the topic's schema, or refused. */
class EncryptedOutboxTest extends TestCase
{
    private const CUSTOMER = ['customer_id' => 7, 'email' => 'ayse@example.com', 'name' => 'Ayşe Yılmaz'];

    protected function outboxConfig(): array
    {
        return ['encryption' => [
            'keyring' => 'storage/keys.json',             // relative: from the base path
            'schemas' => 'resources/outbox',
            'plaintext_topics' => ['audit.ping'],
        ]];
    }

    protected function setUp(): void
    {
        parent::setUp();
        $this->vectorKeyring();
        $this->schema('customer.registered', [
            'customer_id' => ['x-gdpr-sensitive' => false],
            'email' => ['x-gdpr-sensitive' => true, 'x-blind-index' => ['normalize' => ['trim', 'lowercase']]],
            'name' => ['x-gdpr-sensitive' => true],
        ]);
    }

    public function test_the_marked_fields_are_sealed_for_the_event_and_open_again(): void
    {
        $id = DB::transaction(fn () => Outbox::write('customer.registered', 7, self::CUSTOMER));

        $payload = json_decode(DB::table('outbox')->where('id', $id)->value('payload'), true);
        $this->assertSame(7, $payload['customer_id']);
        $this->assertStringStartsWith('enc:v1:', $payload['email']);
        $this->assertStringStartsWith('enc:v1:', $payload['name']);
        $this->assertSame(self::CUSTOMER, $this->app->make(TopicEncryption::class)->open($id, $payload));
    }

    public function test_a_topic_without_a_schema_is_refused_and_nothing_is_written(): void
    {
        try {
            DB::transaction(fn () => Outbox::write('customer.renamed', 7, self::CUSTOMER));
            $this->fail('wrote a topic without a schema while a key ring is configured');
        } catch (CryptoException $e) {
            $this->assertSame('MissingSchema', $e->kind);
            $this->assertStringContainsString('resources/outbox/customer.renamed.json', $e->getMessage());
            $this->assertStringContainsString('plaintext_topics', $e->getMessage());
        }

        $this->assertSame(0, DB::table('outbox')->count());
    }

    public function test_a_field_the_schema_does_not_declare_is_refused(): void
    {
        try {
            DB::transaction(fn () => Outbox::write('customer.registered', 7, self::CUSTOMER + ['phone' => '+49 170 1234567']));
            $this->fail('wrote a field its schema does not declare');
        } catch (CryptoException $e) {
            $this->assertSame('UndeclaredField', $e->kind);
        }

        $this->assertSame(0, DB::table('outbox')->count());
    }

    public function test_a_plaintext_topic_is_written_in_clear(): void
    {
        $id = DB::transaction(fn () => Outbox::write('audit.ping', 1, ['at' => 'now']));

        $this->assertSame(['at' => 'now'], json_decode(DB::table('outbox')->where('id', $id)->value('payload'), true));
    }

    public function test_a_schema_marking_fields_without_a_key_ring_is_refused(): void
    {
        $this->app['config']->set('outbox.encryption.keyring', null);
        $this->app->forgetInstance(TopicEncryption::class);
        $this->app->forgetInstance(\Outboxd\Laravel\Outbox::class);
        Outbox::clearResolvedInstances();

        try {
            DB::transaction(fn () => Outbox::write('customer.registered', 7, self::CUSTOMER));
            $this->fail('wrote marked fields in clear without a key ring');
        } catch (CryptoException $e) {
            $this->assertSame('NoKeyring', $e->kind);
            $this->assertStringContainsString('outbox:keys generate', $e->getMessage());
        }

        $this->assertSame(0, DB::table('outbox')->count());
    }

    public function test_the_blind_index_follows_the_topic_schema(): void
    {
        [$key, $index] = Outbox::blindIndex('customer.registered', 'email', '  AYSE@example.com ');

        $this->assertSame([$key, $index], Outbox::blindIndex('customer.registered', 'email', 'ayse@example.com'));
        $this->assertMatchesRegularExpression('/^[0-9a-f]{16}$/', $index);
    }

    public function test_a_key_ring_others_can_read_is_refused_with_the_fix(): void
    {
        chmod($this->basePath.'/storage/keys.json', 0644);

        try {
            DB::transaction(fn () => Outbox::write('customer.registered', 7, self::CUSTOMER));
            $this->fail('used a key ring others can read');
        } catch (CryptoException $e) {
            $this->assertStringContainsString('fix: chmod 600 '.$this->basePath.'/storage/keys.json', $e->getMessage());
        }
    }
}
