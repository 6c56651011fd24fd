<?php

namespace Outboxd\Laravel\Tests\Unit;

use Outboxd\Laravel\Encryption\CryptoException;
use Outboxd\Laravel\Encryption\FieldCrypto;
use PHPUnit\Framework\TestCase;

/**
 * The enc:v1 format against what the Rust crate wrote: docs/encryption.md's known-answer vector
 * and tests/fixtures/enc-v1 (a payload sealed and blind indexes computed by outboxd, which
 * tests/kit/crypto_php.rs checks on the Rust side).
 */
class FieldCryptoTest extends TestCase
{
    private static function root(): string
    {
        return dirname(__DIR__, 4);
    }

    private static function vectors(): array
    {
        return json_decode(file_get_contents(self::root().'/tests/fixtures/enc-v1/vectors.json'), true, 512, JSON_THROW_ON_ERROR);
    }

    private static function ring(): FieldCrypto
    {
        $ring = FieldCrypto::fromJson(file_get_contents(self::root().'/tests/fixtures/enc-v1/keyring.json'));
        $ring->useSchema(json_decode(file_get_contents(self::root().'/tests/fixtures/enc-v1/schema.json'), true), 'schema.json');

        return $ring;
    }

    public function test_the_documented_known_answer_vector(): void
    {
        $doc = file_get_contents(self::root().'/docs/encryption.md');
        preg_match('/^field key\s+(\S+)$/m', $doc, $key);
        preg_match('/^value\s+(enc:v1:\S+)$/m', $doc, $value);
        $this->assertNotEmpty($key, 'docs/encryption.md has no "field key" line');
        $this->assertNotEmpty($value, 'docs/encryption.md has no "value" line');

        $material = implode('', array_map('chr', range(0, 31)));
        $ring = FieldCrypto::fromJson(json_encode(['outboxd_keyring' => 1, 'current' => 'k1f3a9c0d', 'keys' => [
            ['id' => 'k1f3a9c0d', 'key' => rtrim(strtr(base64_encode($material), '+/', '-_'), '=')],
        ]]));
        $event = hex2bin('0192f3a45b6c7d8e9f00112233445566');
        $nonce = implode('', array_map('chr', range(0x40, 0x57)));

        $this->assertSame($key[1], bin2hex(FieldCrypto::fieldKey($material, 'k1f3a9c0d', '/customer/tax_id')));
        $this->assertSame($value[1], $ring->sealValue('1234567890', 'k1f3a9c0d', $event, '/customer/tax_id', $nonce));
        $this->assertSame('1234567890', $ring->openValue($value[1], $event, '/customer/tax_id'));
    }

    public function test_php_opens_what_outboxd_sealed(): void
    {
        $v = self::vectors();

        $this->assertSame($v['payload'], self::ring()->openPayload($v['event_id'], $v['sealed']));
    }

    public function test_php_computes_outboxd_blind_indexes(): void
    {
        $ring = self::ring();
        foreach (self::vectors()['blind_indexes'] as $case) {
            [$keyId, $hex] = $ring->blindIndex($case['field'], $case['value'], $case['normalize']);
            $this->assertSame($case['index'], "$keyId $hex", $case['field']);
        }
    }

    public function test_what_php_seals_opens_again_and_holds_no_clear_value(): void
    {
        $v = self::vectors();
        $ring = self::ring();

        $sealed = $ring->sealPayload($v['event_id'], $v['payload']);

        foreach (['/customer_name', '/tax_id', '/address/street', '/lines/0/note', '/lines/1/note'] as $pointer) {
            $this->assertStringStartsWith('enc:v1:', $this->pointed($sealed, $pointer), $pointer);
        }
        $this->assertSame('DE', $sealed['address']['country']);
        $this->assertSame('A-1', $sealed['lines'][0]['sku']);
        foreach (['Ayşe', '123-456', 'Große'] as $clear) {
            $this->assertStringNotContainsString($clear, json_encode($sealed, JSON_UNESCAPED_UNICODE));
        }
        $this->assertSame($v['payload'], $ring->openPayload($v['event_id'], $sealed));
    }

    /** @dataProvider tamperings */
    public function test_a_value_tampered_with_moved_or_copied_does_not_open(callable $tamper, string $kind): void
    {
        $v = self::vectors();
        [$sealed, $event] = $tamper($v['sealed'], $v['event_id']);

        try {
            self::ring()->openPayload($event, $sealed);
            $this->fail("opened: expected $kind");
        } catch (CryptoException $e) {
            $this->assertSame($kind, $e->kind, $e->getMessage());
        }
    }

    public function tamperings(): array
    {
        return [
            'one character of the tag' => [function (array $s, string $event) {
                $at = strlen($s['tax_id']) - 8;
                $s['tax_id'][$at] = $s['tax_id'][$at] === 'A' ? 'B' : 'A';

                return [$s, $event];
            }, 'Tampered'],
            'swapped between fields' => [function (array $s, string $event) {
                [$s['tax_id'], $s['customer_name']] = [$s['customer_name'], $s['tax_id']];

                return [$s, $event];
            }, 'MovedField'],
            'copied to another event' => [fn (array $s) => [$s, '0192f3a4-5b6c-7d8e-9f00-112233445567'], 'WrongEvent'],
            'a key this ring does not hold' => [function (array $s, string $event) {
                $s['tax_id'] = preg_replace('/^enc:v1:[^:]+:/', 'enc:v1:k00000000:', $s['tax_id']);

                return [$s, $event];
            }, 'UnknownKeyId'],
        ];
    }

    public function test_an_undeclared_field_is_refused_not_written_in_clear(): void
    {
        $v = self::vectors();
        $payload = $v['payload'] + ['email' => 'ayse@example.com'];

        try {
            self::ring()->sealPayload($v['event_id'], $payload);
            $this->fail('sealed a payload with a field its schema does not declare');
        } catch (CryptoException $e) {
            $this->assertSame('UndeclaredField', $e->kind);
            $this->assertStringContainsString('/email', $e->getMessage());
            $this->assertStringNotContainsString('ayse@example.com', $e->getMessage());
        }
    }

    public function test_a_marked_field_out_of_reach_is_refused(): void
    {
        $v = self::vectors();
        $payload = $v['payload'];
        $payload['address'] = 'Große Straße 1, Berlin';   // the schema has an object with a sealed street

        try {
            self::ring()->sealPayload($v['event_id'], $payload);
            $this->fail('sealed a payload whose marked field it cannot reach');
        } catch (CryptoException $e) {
            $this->assertSame('CannotSeal', $e->kind);
            $this->assertStringContainsString('/address', $e->getMessage());
        }
    }

    private function pointed(array $doc, string $pointer): mixed
    {
        foreach (array_slice(explode('/', $pointer), 1) as $seg) {
            $doc = $doc[$seg];
        }

        return $doc;
    }
}
