<?php

use Illuminate\Database\Migrations\Migration;
use Illuminate\Support\Facades\DB;
use Illuminate\Support\Facades\Schema;

/*
 * The consumers' tables, byte for byte outboxd's (migrations/mysql/003_processed_messages.sql),
 * so PHP and Rust consumers can share them and `outboxd prune` recognises them:
 *
 * processed_messages: one claim per consumer and message id, written in the transaction of the
 * message's effect. Names and ids are VARBINARY/BINARY, compared byte for byte (a VARCHAR's
 * collation would merge `Billing` and `billing`), which the schema builder cannot declare on
 * every Laravel version: hence the DDL.
 *
 * consumer_aggregate_versions: the stale gate, the last applied x-aggregate-version per
 * consumer and aggregate (its outbox table, type and id). A table created by an earlier
 * release of outboxd's kit is brought to this key by `outboxd consumer setup` (or the kit's
 * setup), which migrates it in place.
 */
return new class extends Migration
{
    public function getConnection()
    {
        return config('outbox.connection');
    }

    public function up(): void
    {
        $db = DB::connection($this->getConnection());
        if (! in_array($db->getDriverName(), ['mysql', 'mariadb'], true)) {
            throw new RuntimeException('outbox:consume keeps its claims on MySQL or MariaDB; the "'.$db->getName().'" connection is '.$db->getDriverName());
        }
        $db->statement(<<<'SQL'
            CREATE TABLE IF NOT EXISTS processed_messages (
                consumer      VARBINARY(100) NOT NULL,
                message_id    BINARY(16)     NOT NULL,
                processed_at  DATETIME(6)    NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
                PRIMARY KEY (consumer, message_id),
                KEY idx_processed_at (processed_at)
            ) ENGINE = InnoDB
            SQL);
        $db->statement(<<<'SQL'
            CREATE TABLE IF NOT EXISTS consumer_aggregate_versions (
                consumer        VARBINARY(100)  NOT NULL,
                outbox_table    VARBINARY(255)  NOT NULL DEFAULT '',
                aggregate_type  VARBINARY(255)  NOT NULL DEFAULT '',
                aggregate_id    VARBINARY(1024) NOT NULL,
                version         BIGINT          NOT NULL,
                updated_at      DATETIME(6)     NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
                PRIMARY KEY (consumer, outbox_table, aggregate_type, aggregate_id)
            ) ENGINE = InnoDB
            SQL);
    }

    public function down(): void
    {
        Schema::connection($this->getConnection())->dropIfExists('consumer_aggregate_versions');
        Schema::connection($this->getConnection())->dropIfExists('processed_messages');
    }
};
