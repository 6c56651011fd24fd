<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Encryption;

/**
 * Which topics are sealed and with which schema, from `config('outbox.encryption')`: the key
 * ring file `outboxd keys generate` writes, and a directory of `<topic>.json` schemas marking
 * each topic's `x-gdpr-sensitive` fields.
 *
 * It fails closed both ways: with a key ring, a topic without a schema is refused unless it is
 * listed as plaintext; without a key ring, a topic whose schema marks sensitive fields is
 * refused. Neither case writes personal data in clear by accident.
 */
class TopicEncryption
{
    private ?FieldCrypto $ring = null;

    /** @var array<string, FieldCrypto|false> per topic: its sealer, or false for plaintext */
    private array $topics = [];

    /**
     * @param  string|null  $keyring  the key ring file, absolute (null: encryption off)
     * @param  string  $schemas  the directory of `<topic>.json` schema files, absolute
     * @param  list<string>  $plaintext  topics written in clear although a key ring is set
     */
    public function __construct(
        private readonly ?string $keyring,
        private readonly string $schemas,
        private readonly array $plaintext = [],
    ) {
    }

    /** From `config('outbox.encryption')`; relative paths are taken from the application's base path. */
    public static function fromConfig(array $config, string $basePath): self
    {
        $absolute = static fn (?string $path): ?string => $path === null || $path === '' ? null
            : (str_starts_with($path, '/') ? $path : rtrim($basePath, '/') . '/' . $path);

        return new self(
            $absolute($config['keyring'] ?? null),
            $absolute($config['schemas'] ?? null) ?? rtrim($basePath, '/') . '/resources/outbox',
            array_values($config['plaintext_topics'] ?? []),
        );
    }

    public function enabled(): bool
    {
        return $this->keyring !== null;
    }

    public function keyringPath(): ?string
    {
        return $this->keyring;
    }

    public function schemaPath(string $topic): string
    {
        if (!preg_match('/^[A-Za-z0-9][A-Za-z0-9._:-]*$/', $topic) || str_contains($topic, '..')) {
            throw new CryptoException('Schema', "topic \"$topic\" cannot name a schema file\n  fix: use letters, digits and . _ : - in topic names");
        }

        return rtrim($this->schemas, '/') . "/$topic.json";
    }

    /** The key ring, loaded (and its canaries checked) once. */
    public function keyring(): FieldCrypto
    {
        if ($this->keyring === null) {
            throw new CryptoException('NoKeyring', "no key ring is configured\n  fix: php artisan outbox:keys generate, then set OUTBOX_KEYRING (config outbox.encryption.keyring) to the file it wrote");
        }

        return $this->ring ??= FieldCrypto::load($this->keyring);
    }

    /**
     * The sealer for `$topic`, or null when its payloads go in clear. Throws when writing the
     * topic would leave personal data in clear or when its schema cannot be read.
     */
    public function forTopic(string $topic): ?FieldCrypto
    {
        if (isset($this->topics[$topic])) {
            return $this->topics[$topic] ?: null;
        }
        $path = $this->schemaPath($topic);
        $schema = is_file($path) ? $this->readSchema($path) : null;
        if (in_array($topic, $this->plaintext, true)) {
            if ($schema !== null && self::marks($schema)) {
                throw new CryptoException('Schema', "topic $topic is listed in outbox.encryption.plaintext_topics but $path marks sensitive fields\n  fix: remove it from plaintext_topics (its fields are then sealed), or unmark the fields");
            }

            return ($this->topics[$topic] = false) ?: null;
        }
        if ($this->keyring === null) {
            if ($schema !== null && self::marks($schema)) {
                throw new CryptoException('NoKeyring', "topic $topic: $path marks sensitive fields but no key ring is configured, so they would be written in clear\n  fix: php artisan outbox:keys generate, then set OUTBOX_KEYRING (config outbox.encryption.keyring) to the file it wrote");
            }

            return ($this->topics[$topic] = false) ?: null;
        }
        if ($schema === null) {
            throw new CryptoException('MissingSchema', "topic $topic has no schema ($path), so which of its fields are personal data is unknown\n  fix: create $path marking them, e.g. {\"email\": {\"x-gdpr-sensitive\": true}, \"total\": {\"x-gdpr-sensitive\": false}}, or list the topic in outbox.encryption.plaintext_topics");
        }

        return $this->topics[$topic] = $this->keyring()->withSchema($schema, $path);
    }

    /** Opens every `enc:` value of a payload (a consumer needs no schema). */
    public function open(string $eventId, array $payload): array
    {
        if ($this->keyring === null && self::holdsSealed($payload)) {
            throw new CryptoException('NoKeyring', "the payload holds encrypted fields but no key ring is configured\n  fix: set OUTBOX_KEYRING (config outbox.encryption.keyring) to a copy of the producer's key ring");
        }

        return $this->keyring === null ? $payload : $this->keyring()->openPayload($eventId, $payload);
    }

    private function readSchema(string $path): array
    {
        try {
            $schema = json_decode((string) file_get_contents($path), true, 512, JSON_THROW_ON_ERROR);
        } catch (\JsonException $e) {
            throw new CryptoException('Schema', "$path: not JSON: {$e->getMessage()}");
        }
        if (!is_array($schema)) {
            throw new CryptoException('Schema', "$path: not a JSON object");
        }

        return $schema;
    }

    private static function marks(mixed $v): bool
    {
        if (!is_array($v)) {
            return false;
        }
        if (($v['x-gdpr-sensitive'] ?? false) === true) {
            return true;
        }
        foreach ($v as $child) {
            if (self::marks($child)) {
                return true;
            }
        }

        return false;
    }

    private static function holdsSealed(mixed $v): bool
    {
        if (is_string($v)) {
            return FieldCrypto::looksEncrypted($v);
        }
        if (is_array($v)) {
            foreach ($v as $child) {
                if (self::holdsSealed($child)) {
                    return true;
                }
            }
        }

        return false;
    }
}
