<?php

return [

    /*
    |--------------------------------------------------------------------------
    | Outbox Table
    |--------------------------------------------------------------------------
    |
    | Outbox::write inserts into this table on this connection (null: the
    | default connection), inside the transaction open there. outboxd relays
    | the committed rows. Set "migrations" to false when you publish the
    | migrations (php artisan vendor:publish --tag=outbox-migrations) and
    | change them.
    |
    */

    'connection' => env('OUTBOX_CONNECTION'),

    'table' => env('OUTBOX_TABLE', 'outbox'),

    'migrations' => true,

    /*
    |--------------------------------------------------------------------------
    | Field Encryption
    |--------------------------------------------------------------------------
    |
    | The key ring is the file `php artisan outbox:keys generate` (outboxd keys
    | generate) writes: keep it out of git (storage/app is ignored by Laravel's
    | .gitignore) and back it up. Each topic has a schema, "<schemas>/<topic>.json",
    | marking its personal fields {"x-gdpr-sensitive": true}; those are sealed
    | in outboxd's enc:v1 format before the INSERT.
    |
    | It fails closed: with a key ring, a topic without a schema is refused
    | unless listed in "plaintext_topics", and so is a payload field its schema
    | does not declare; without a key ring, a topic whose schema marks fields
    | is refused. Relative paths are taken from the application's base path.
    |
    */

    'encryption' => [
        'keyring' => env('OUTBOX_KEYRING'),
        'schemas' => env('OUTBOX_SCHEMAS', 'resources/outbox'),
        'plaintext_topics' => [],
    ],

    /*
    |--------------------------------------------------------------------------
    | RabbitMQ (outbox:consume)
    |--------------------------------------------------------------------------
    |
    | The broker outboxd publishes to, and the exchange it declares (outboxd
    | run --exchange). Consumers wait for the exchange rather than fail when
    | they start before the relay.
    |
    */

    'rabbitmq' => [
        'host' => env('OUTBOX_RABBITMQ_HOST', '127.0.0.1'),
        'port' => (int) env('OUTBOX_RABBITMQ_PORT', 5672),
        'user' => env('OUTBOX_RABBITMQ_USER', 'guest'),
        'password' => env('OUTBOX_RABBITMQ_PASSWORD', 'guest'),
        'vhost' => env('OUTBOX_RABBITMQ_VHOST', '/'),
        'exchange' => env('OUTBOX_EXCHANGE', 'outbox'),
    ],

    /*
    |--------------------------------------------------------------------------
    | Consumers
    |--------------------------------------------------------------------------
    |
    | One entry per `php artisan outbox:consume <name>`. The name is the key of
    | its claims in processed_messages (each message's effect happens once per
    | consumer). "handlers" maps topics (wildcards allowed: "invoice.*") to
    | classes whose handle(OutboxMessage $message) runs inside the database
    | transaction holding the claim. The queue is bound to the exchange by
    | "bindings"; "<queue>.dead" takes messages no retry can apply.
    |
    */

    'consumers' => [
        // 'billing' => [
        //     'queue' => 'billing',
        //     'bindings' => ['invoice.*'],
        //     'handlers' => [
        //         'invoice.issued' => App\Listeners\BookInvoice::class,
        //     ],
        // ],
    ],

    /*
    |--------------------------------------------------------------------------
    | The Relay (outbox:prune, outbox:keys)
    |--------------------------------------------------------------------------
    |
    | "mode" is the relay's: in poll mode outbox:prune deletes only rows
    | already marked published (a pending row is an event not yet sent).
    | The database DSN is built from the outbox connection and passed to
    | outboxd in its environment, never on its command line.
    |
    */

    'relay' => [
        'binary' => env('OUTBOXD_BINARY', 'outboxd'),
        'mode' => env('OUTBOXD_MODE', 'cdc'),
    ],

    'prune' => [
        'outbox' => env('OUTBOX_PRUNE_OUTBOX', '7d'),
        'processed_messages' => env('OUTBOX_PRUNE_PROCESSED', '7d'),
    ],

];
