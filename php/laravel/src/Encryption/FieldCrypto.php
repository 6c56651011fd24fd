<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Encryption;

/**
 * Field-level encryption in outboxd's `enc:v1` format (docs/encryption.md) with PHP's sodium.
 *
 * The fields a topic's schema marks `x-gdpr-sensitive` are sealed before the outbox INSERT, so
 * personal data never reaches the table, the binlog, the broker or a log in clear. Values sealed
 * here open with `outboxd decrypt` and the Rust kit, and theirs open here: same key ring file,
 * same HKDF derivation, same associated data (format version, key id, event id, JSON Pointer),
 * same bytes. Also the blind index (`outboxd keys blind-index`). Per-aggregate data keys (`d-…`,
 * a keystore) are not handled here: such a value fails with a clear error.
 *
 * Sealing fails closed: a payload field the schema does not declare, or a marked field the
 * payload's shape keeps out of reach, is refused rather than written in clear.
 */
final class FieldCrypto
{
    private const MARKER = 'x-gdpr-sensitive';
    private const NONCE_LEN = 24;
    private const CHECK_LEN = 4;
    private const TAG_LEN = 16;
    private const MAX_BODY = (1 << 28) - 1;
    private const JSON_FLAGS = JSON_UNESCAPED_SLASHES | JSON_UNESCAPED_UNICODE
        | JSON_PRESERVE_ZERO_FRACTION | JSON_THROW_ON_ERROR;

    /**
     * @param array<string,string> $keys    encryption key id => 32 bytes of material
     * @param array<string,true>   $retired key ids whose material was removed
     * @param array<string,array{key:string,length:int}> $blind blind-index keys
     * @param list<list<string>>   $marked  the schema's marked paths, '*' = every array element
     * @param array<string,list<string>> $normalize blind-index steps per marked pointer
     */
    private function __construct(
        private readonly string $current,
        private readonly array $keys,
        private readonly array $retired,
        private readonly string $blindCurrent,
        private readonly array $blind,
        private array $marked = [],
        private array $normalize = [],
        private ?array $shape = null,
        private string $schemaName = 'the schema',
    ) {
    }

    /**
     * Loads a key ring file written by `outboxd keys generate`. Like outboxd, refuses a file
     * that group or others may read or that another user owns, and checks every key's canary,
     * so a key mangled in a copy fails here rather than after it has sealed data.
     */
    public static function load(string $keyringPath): self
    {
        $st = @stat($keyringPath);
        if ($st === false) {
            throw new CryptoException('Keyring', "keyring $keyringPath: cannot read it\n  fix: php artisan outbox:keys generate, or point OUTBOX_KEYRING (config outbox.encryption.keyring) at the file `outboxd keys generate` wrote");
        }
        if (($st['mode'] & 0o077) !== 0 && !($st['uid'] === 0 && ($st['mode'] & 0o037) === 0)) {
            throw new CryptoException('Keyring', sprintf("keyring %s: mode %o lets group or others read it\n  fix: chmod 600 %s", $keyringPath, $st['mode'] & 0o777, $keyringPath));
        }
        if (function_exists('posix_geteuid') && $st['uid'] !== posix_geteuid() && $st['uid'] !== 0) {
            throw new CryptoException('Keyring', "keyring $keyringPath: owned by another user\n  fix: chown \$(id -u) $keyringPath");
        }
        return self::fromJson((string) file_get_contents($keyringPath));
    }

    public static function fromJson(string $json): self
    {
        $k = json_decode($json, true, 512, JSON_THROW_ON_ERROR);
        if (($k['outboxd_keyring'] ?? null) !== 1 || !is_string($k['current'] ?? null)) {
            throw new CryptoException('Keyring', "keyring: not an outboxd key ring (version 1)\n  fix: create one with outboxd keys generate --keys PATH");
        }
        $keys = [];
        $retired = [];
        foreach ($k['keys'] as $e) {
            self::validateKeyId($e['id']);
            if (!isset($e['key'])) {
                $retired[$e['id']] = true;
                continue;
            }
            $keys[$e['id']] = self::b64d($e['key'], 'keyring');
            if (strlen($keys[$e['id']]) !== 32) {
                throw new CryptoException('Keyring', "keyring: key {$e['id']} is not 32 bytes\n  fix: restore the keyring from its backup");
            }
        }
        if (!isset($keys[$k['current']])) {
            throw new CryptoException('Keyring', "keyring: the current key {$k['current']} has no material\n  fix: outboxd keys rotate --keys PATH");
        }
        $blind = [];
        foreach ($k['blind_index']['keys'] ?? [] as $e) {
            $blind[$e['id']] = ['key' => self::b64d($e['key'], 'keyring'), 'length' => (int) $e['length']];
        }
        $ring = new self($k['current'], $keys, $retired, (string) ($k['blind_index']['current'] ?? ''), $blind);
        foreach ($k['keys'] as $e) {
            if (isset($e['key'], $e['canary'])) {
                try {
                    $ring->openValue($e['canary'], str_repeat("\0", 16), '/outboxd/canary');
                } catch (CryptoException) {
                    throw new CryptoException('Canary', "keyring: key {$e['id']} fails its canary check\n  fix: restore the keyring from the backup taken when the key was made");
                }
            }
        }
        foreach ($k['blind_index']['keys'] ?? [] as $e) {
            $check = bin2hex(substr(self::blindMac($blind[$e['id']]['key'], $e['id'], '/outboxd/canary', 'outboxd keyring canary'), 0, 8));
            if (isset($e['check']) && !hash_equals($e['check'], $check)) {
                throw new CryptoException('Canary', "keyring: key {$e['id']} fails its canary check\n  fix: restore the keyring from the backup taken when the key was made");
            }
        }
        return $ring;
    }

    /**
     * The schema (JSON Schema style with `properties`/`items`, or the flat form). A marker
     * under a keyword this walk does not follow is refused, not ignored: ignoring it would leave
     * personal data in clear.
     */
    public function useSchema(array $schema, string $name = 'the schema'): void
    {
        $this->marked = [];
        $this->normalize = [];
        $this->schemaName = $name;
        $props = $schema['properties'] ?? null;
        $jsonSchema = is_array($props) && !array_key_exists(self::MARKER, $props)
            && array_filter($props, 'is_array') === $props;
        if ($jsonSchema) {
            $this->compile($schema, []);
            $this->shape = self::shapeOf($schema);
        } else {
            $fields = [];
            foreach ($schema as $field => $node) {
                if (!is_array($node)) {
                    throw new CryptoException('Schema', "$name: field \"$field\" is not an object\n  fix: write \"$field\": {\"x-gdpr-sensitive\": true}");
                }
                $this->compile($node, [(string) $field]);
                $fields[(string) $field] = self::shapeOf($node);
            }
            $this->shape = ['sensitive' => false, 'fields' => $fields, 'items' => null,
                'marks' => array_sum(array_column($fields, 'marks'))];
        }
        $reached = count($this->marked);
        if (self::countMarkers($schema) !== $reached) {
            throw new CryptoException('Schema', "$this->schemaName: an x-gdpr-sensitive marker sits under a keyword this walk does not follow (\$ref, allOf, anyOf, oneOf, patternProperties, additionalProperties, …)\n  fix: inline the field under \"properties\" or \"items\"");
        }
    }

    private function compile(array $node, array $path): void
    {
        if (($node[self::MARKER] ?? false) === true) {
            if ($path === []) {
                throw new CryptoException('Schema', "$this->schemaName: the whole payload is marked sensitive\n  fix: mark the personal fields, not the root");
            }
            $this->marked[] = $path;
            $steps = $node['x-blind-index']['normalize'] ?? null;
            if (is_array($steps)) {
                $this->normalize[self::pointer($path)] = $steps;
            }
            return;
        }
        foreach (($node['properties'] ?? []) as $name => $child) {
            if (is_array($child)) {
                $this->compile($child, [...$path, (string) $name]);
            }
        }
        if (isset($node['items']) && is_array($node['items']) && !array_is_list($node['items'])) {
            $this->compile($node['items'], [...$path, '*']);
        }
    }

    private static function countMarkers(mixed $v): int
    {
        if (!is_array($v)) {
            return 0;
        }
        $n = (($v[self::MARKER] ?? false) === true) ? 1 : 0;
        foreach ($v as $child) {
            $n += self::countMarkers($child);
        }
        return $n;
    }

    /**
     * The shape the seal walks: per node whether it is sensitive, its declared object fields
     * (`properties`, or the flat form's names), its array elements (`items`) and how many
     * sensitive fields sit at or under it.
     *
     * @return array{sensitive:bool,fields:?array<string,array>,items:?array,marks:int}
     */
    private static function shapeOf(array $node): array
    {
        $sensitive = ($node[self::MARKER] ?? false) === true;
        $fields = null;
        if (isset($node['properties']) && is_array($node['properties'])) {
            $fields = [];
            foreach ($node['properties'] as $name => $child) {
                $fields[(string) $name] = self::shapeOf(is_array($child) ? $child : []);
            }
        }
        $items = isset($node['items']) && is_array($node['items']) && !array_is_list($node['items'])
            ? self::shapeOf($node['items']) : null;
        $marks = ($sensitive ? 1 : 0) + array_sum(array_column($fields ?? [], 'marks')) + ($items['marks'] ?? 0);

        return ['sensitive' => $sensitive, 'fields' => $fields, 'items' => $items, 'marks' => $marks];
    }

    /** The key new values are sealed with. */
    public function currentKeyId(): string
    {
        return $this->current;
    }

    /** Whether a schema was given (sealing without one is refused). */
    public function hasSchema(): bool
    {
        return $this->shape !== null;
    }

    /** A copy of this key ring with `$schema` as its schema (one per topic). */
    public function withSchema(array $schema, string $name): self
    {
        $ring = clone $this;
        $ring->useSchema($schema, $name);

        return $ring;
    }

    /**
     * Seals the marked fields of `$payload` (decoded as arrays) for event `$eventId`. Refuses a
     * field the schema does not declare (it may hold personal data nobody marked) and a marked
     * field the payload's shape hides (an object where the schema has none): neither is written
     * in clear.
     */
    public function sealPayload(string $eventId, array $payload): array
    {
        $event = self::uuidBytes($eventId);
        if ($event === str_repeat("\0", 16)) {
            throw new CryptoException('NilEventId', 'refusing to encrypt for the nil event id, which is reserved');
        }
        if ($this->shape === null) {
            throw new CryptoException('Schema', "no schema to seal with\n  fix: give the topic a schema marking its x-gdpr-sensitive fields");
        }

        return $this->sealNode($payload, $this->shape, '', $event);
    }

    private function sealNode(mixed $node, array $shape, string $at, string $event): mixed
    {
        if ($shape['sensitive']) {
            if ($at === '') {
                throw new CryptoException('Schema', "{$this->schemaName}: the whole payload is marked sensitive\n  fix: mark the personal fields, not the root");
            }
            if (is_string($node) && self::looksEncrypted($node)) {
                throw new CryptoException('AlreadyEncrypted', "$at: already encrypted; decrypt first");
            }

            return $this->sealValue($node, $this->current, $event, $at);
        }
        $where = $at === '' ? 'the payload' : $at;
        if ($shape['fields'] !== null) {
            if ($node === null || $node === []) {
                return $node;
            }
            if (!is_array($node) || array_is_list($node)) {
                if ($shape['marks'] > 0) {
                    throw new CryptoException('CannotSeal', "$where: {$this->schemaName} describes an object with sensitive fields here, the payload has " . get_debug_type($node) . "\n  fix: send the object the schema describes, or change the schema");
                }
                self::refuseAmbiguous($node, $at);

                return $node;
            }
            foreach ($node as $k => $v) {
                $k = (string) $k;
                if (!isset($shape['fields'][$k])) {
                    throw new CryptoException('UndeclaredField', "$at/" . self::escape($k) . ": not in {$this->schemaName}, so it cannot be known not to hold personal data\n  fix: declare it there, \"$k\": {\"x-gdpr-sensitive\": true} or false");
                }
                $node[$k] = $this->sealNode($v, $shape['fields'][$k], $at . '/' . self::escape($k), $event);
            }

            return $node;
        }
        if ($shape['items'] !== null && $shape['marks'] > 0) {
            if ($node === null || $node === []) {
                return $node;
            }
            if (!is_array($node) || !array_is_list($node)) {
                throw new CryptoException('CannotSeal', "$where: {$this->schemaName} describes an array with sensitive fields here, the payload has " . get_debug_type($node) . "\n  fix: send the array the schema describes, or change the schema");
            }
            foreach ($node as $i => $v) {
                $node[$i] = $this->sealNode($v, $shape['items'], "$at/$i", $event);
            }

            return $node;
        }
        self::refuseAmbiguous($node, $at);

        return $node;
    }

    /** A clear string readers would take for ciphertext is refused (outside marked fields). */
    private static function refuseAmbiguous(mixed $v, string $at): void
    {
        if (is_string($v) && self::looksEncrypted($v)) {
            throw new CryptoException('AmbiguousClearValue', "$at: a clear value starts with \"enc:\" and would be read as ciphertext; change the value or mark the field sensitive");
        }
        if (is_array($v)) {
            foreach ($v as $k => $child) {
                self::refuseAmbiguous($child, $at . '/' . self::escape((string) $k));
            }
        }
    }

    /** Opens every `enc:` value of a payload, wherever it sits (needs no schema). */
    public function openPayload(string $eventId, array $payload): array
    {
        return $this->openWalk($payload, '', self::uuidBytes($eventId));
    }

    private function openWalk(mixed $v, string $at, string $event): mixed
    {
        if (is_string($v) && self::looksEncrypted($v)) {
            return $this->openValue($v, $event, $at);
        }
        if (is_array($v)) {
            foreach ($v as $k => $child) {
                $v[$k] = $this->openWalk($child, $at . '/' . self::escape((string) $k), $event);
            }
        }
        return $v;
    }

    /**
     * Seals one value. `$nonce` is for the documented known-answer vector only: a nonce must
     * never repeat under a key, so everything else takes a fresh random one.
     */
    public function sealValue(mixed $value, string $keyId, string $event, string $pointer, ?string $nonce = null): string
    {
        $material = $this->keys[$keyId] ?? throw new CryptoException('UnknownKeyId', "$pointer: no key $keyId");
        $plain = json_encode($value, self::JSON_FLAGS);
        $nonce ??= random_bytes(self::NONCE_LEN);
        $key = self::fieldKey($material, $keyId, $pointer);
        $sealed = sodium_crypto_aead_xchacha20poly1305_ietf_encrypt($plain, self::ad($keyId, $event, $pointer), $nonce, $key);
        sodium_memzero($key);
        $bytes = $nonce . self::checks($event, $pointer) . self::varint(strlen($plain)) . $sealed;
        return "enc:v1:$keyId:" . rtrim(strtr(base64_encode($bytes), '+/', '-_'), '=');
    }

    /** Opens one value sealed for (`$event` as 16 bytes, `$pointer`); returns the JSON value. */
    public function openValue(string $value, string $event, string $pointer): mixed
    {
        if (!preg_match('/^enc:v([^:]*):/', $value, $m)) {
            throw new CryptoException('Malformed', "$pointer: malformed encrypted value: no version");
        }
        if ($m[1] !== '1') {
            throw new CryptoException('UnsupportedVersion', "$pointer: encrypted value has format version \"v{$m[1]}\"; this reads v1 only");
        }
        if (!preg_match('/^enc:v1:([A-Za-z0-9_-]{1,32}):(.*)$/s', $value, $m)) {
            throw new CryptoException('Malformed', "$pointer: malformed encrypted value: the key id is not [A-Za-z0-9_-]{1,32}");
        }
        [, $keyId, $b64] = $m;
        if (str_starts_with($keyId, 'd-')) {
            throw new CryptoException('NeedKeystore', "$pointer: sealed with the per-aggregate data key $keyId; open it with outboxd decrypt --keystore DSN");
        }
        $material = $this->keys[$keyId] ?? throw new CryptoException(
            isset($this->retired[$keyId]) ? 'KeyMissing' : 'UnknownKeyId',
            isset($this->retired[$keyId])
                ? "$pointer: key \"$keyId\" was retired and its material removed; restore the keyring from a backup"
                : "$pointer: encrypted with key \"$keyId\", which this keyring does not hold; decrypt with the keyring that wrote it"
        );
        $b = self::b64d($b64, $pointer);
        $fixed = self::NONCE_LEN + self::CHECK_LEN;
        if (strlen($b) < $fixed + 1 + self::TAG_LEN) {
            throw new CryptoException('Truncated', "$pointer: encrypted value is truncated");
        }
        [$len, $n] = self::readVarint($b, $fixed, $pointer);
        $total = $fixed + $n + $len + self::TAG_LEN;
        if (strlen($b) < $total) {
            throw new CryptoException('Truncated', "$pointer: encrypted value is truncated: " . strlen($b) . " bytes where $total were written");
        }
        if (strlen($b) > $total) {
            throw new CryptoException('Malformed', "$pointer: malformed encrypted value: " . (strlen($b) - $total) . ' bytes after the tag');
        }
        $key = self::fieldKey($material, $keyId, $pointer);
        $plain = sodium_crypto_aead_xchacha20poly1305_ietf_decrypt(
            substr($b, $fixed + $n),
            self::ad($keyId, $event, $pointer),
            substr($b, 0, self::NONCE_LEN),
            $key
        );
        sodium_memzero($key);
        $have = substr($b, self::NONCE_LEN, self::CHECK_LEN);
        $want = self::checks($event, $pointer);
        if ($plain === false) {
            // The tag failed: the clear check bytes say which binding did not match.
            if (substr($have, 0, 2) !== substr($want, 0, 2)) {
                throw new CryptoException('WrongEvent', "$pointer: this value was encrypted for another event");
            }
            if (substr($have, 2) !== substr($want, 2)) {
                throw new CryptoException('MovedField', "$pointer: this value was encrypted for another field");
            }
            throw new CryptoException('Tampered', "$pointer: authentication failed: the encrypted value (key \"$keyId\") was altered");
        }
        if (!hash_equals($want, $have)) {
            throw new CryptoException('Tampered', "$pointer: authentication failed: the check bytes were altered");
        }
        try {
            return json_decode($plain, true, 512, JSON_THROW_ON_ERROR);
        } catch (\JsonException) {
            throw new CryptoException('Malformed', "$pointer: the decrypted value is not JSON");
        }
    }

    /**
     * The blind index of `$value` for `$field` (a pointer or a top-level name) under the current
     * blind-index key: `[key id, lowercase hex]`, as `outboxd keys blind-index` prints it.
     * Normalisation: `$steps`, else the schema's `x-blind-index.normalize`, else trim.
     */
    public function blindIndex(string $field, string $value, ?array $steps = null): array
    {
        $pointer = str_starts_with($field, '/') ? $field : '/' . self::escape($field);
        $steps ??= $this->normalize[$pointer] ?? ['trim'];
        foreach ($steps as $step) {
            $value = match ($step) {
                'trim' => trim($value, " \t\n\r\0\x0B\u{85}\u{A0}\u{1680}\u{2000}\u{2001}\u{2002}\u{2003}\u{2004}\u{2005}\u{2006}\u{2007}\u{2008}\u{2009}\u{200A}\u{2028}\u{2029}\u{202F}\u{205F}\u{3000}"),
                'lowercase' => mb_strtolower($value, 'UTF-8'),
                'digits' => preg_replace('/[^0-9]/', '', $value),
                'alnum' => mb_strtoupper(preg_replace('/[^\p{L}\p{N}]/u', '', $value), 'UTF-8'),
                'collapse-space' => implode(' ', preg_split('/\s+/u', $value, -1, PREG_SPLIT_NO_EMPTY)),
                'none' => $value,
                default => throw new CryptoException('Schema', "unknown normalisation \"$step\"\n  fix: use trim, lowercase, digits, alnum or collapse-space"),
            };
        }
        $k = $this->blind[$this->blindCurrent] ?? throw new CryptoException('Keyring', 'keyring: no blind-index key');
        $mac = self::blindMac($k['key'], $this->blindCurrent, $pointer, $value);
        return [$this->blindCurrent, bin2hex(substr($mac, 0, max(1, min(32, $k['length']))))];
    }

    public static function looksEncrypted(string $s): bool
    {
        return preg_match('/^enc:v[0-9]+:/', $s) === 1;
    }

    /** The event id's 16 bytes (RFC 4122 order) from its hyphenated or plain hex form. */
    public static function uuidBytes(string $id): string
    {
        $hex = str_replace('-', '', $id);
        if (!preg_match('/^[0-9a-fA-F]{32}$/', $hex)) {
            throw new CryptoException('Malformed', "event id \"$id\" is not a UUID");
        }
        return hex2bin($hex);
    }

    /** The documented field key (HKDF-SHA256, no salt), exposed for the known-answer vector. */
    public static function fieldKey(string $material, string $keyId, string $pointer): string
    {
        // An empty salt is HMAC'd as HashLen zero bytes, which is what RFC 5869 prescribes.
        return hash_hkdf('sha256', $material, 32, self::lp(['outboxd field key', 'v1', $keyId, $pointer]), '');
    }

    private static function blindMac(string $material, string $keyId, string $pointer, string $normalized): string
    {
        $k = hash_hkdf('sha256', $material, 32, self::lp(['outboxd blind index', 'v1', $keyId, $pointer]), '');
        return hash_hmac('sha256', $normalized, $k, true);
    }

    private static function ad(string $keyId, string $event, string $pointer): string
    {
        return self::lp(['v1', $keyId, $event, $pointer]);
    }

    private static function checks(string $event, string $pointer): string
    {
        return substr(hash('sha256', $event, true), 0, 2) . substr(hash('sha256', $pointer, true), 0, 2);
    }

    /** @param list<string> $items each as a 4-byte big-endian length, then its bytes */
    private static function lp(array $items): string
    {
        $out = '';
        foreach ($items as $i) {
            $out .= pack('N', strlen($i)) . $i;
        }
        return $out;
    }

    private static function varint(int $n): string
    {
        $out = '';
        do {
            $b = $n & 0x7f;
            $n >>= 7;
            $out .= chr($n ? $b | 0x80 : $b);
        } while ($n);
        return $out;
    }

    /** @return array{int,int} value and byte count; canonical, at most 4 bytes */
    private static function readVarint(string $b, int $at, string $pointer): array
    {
        $n = 0;
        for ($i = 0; $i < 4 && $at + $i < strlen($b); $i++) {
            $c = ord($b[$at + $i]);
            $n |= ($c & 0x7f) << (7 * $i);
            if (($c & 0x80) === 0) {
                if ($i > 0 && $c === 0) {
                    break;
                }
                if ($n > self::MAX_BODY) {
                    throw new CryptoException('Malformed', "$pointer: malformed encrypted value: length field out of range");
                }
                return [$n, $i + 1];
            }
        }
        throw new CryptoException('Malformed', "$pointer: malformed encrypted value: bad length field");
    }

    /** Strict unpadded URL-safe base64 (RFC 4648 §5): other characters or trailing bits refused. */
    private static function b64d(string $s, string $where): string
    {
        $bytes = preg_match('/^[A-Za-z0-9_-]*$/', $s) && strlen($s) % 4 !== 1
            ? base64_decode(strtr($s, '-_', '+/'), true) : false;
        if ($bytes === false || rtrim(strtr(base64_encode($bytes), '+/', '-_'), '=') !== $s) {
            throw new CryptoException('Malformed', "$where: malformed encrypted value: not unpadded URL-safe base64 (RFC 4648 §5)");
        }
        return $bytes;
    }

    private static function validateKeyId(string $id): void
    {
        if (!preg_match('/^[A-Za-z0-9_-]{1,32}$/', $id)) {
            throw new CryptoException('Keyring', "keyring: key id \"$id\" is not [A-Za-z0-9_-]{1,32}");
        }
    }

    private static function escape(string $seg): string
    {
        return str_replace(['~', '/'], ['~0', '~1'], $seg);
    }

    /** @param list<string> $path */
    private static function pointer(array $path): string
    {
        return implode('', array_map(fn ($s) => '/' . self::escape($s), $path));
    }
}
