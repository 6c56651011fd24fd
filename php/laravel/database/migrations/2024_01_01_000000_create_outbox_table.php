<?php

use Illuminate\Database\Migrations\Migration;
use Illuminate\Database\Schema\Blueprint;
use Illuminate\Support\Facades\Schema;

/*
 * The outbox table in the layout outboxd reads without any --column option: a UUID v7 id (the
 * message_id consumers deduplicate on), the topic, the aggregate's type, id and version (sent
 * as x-aggregate-*), the JSON payload, and the status poll mode claims ('pending') and marks
 * ('published'). DATETIME(6) columns hold UTC.
 */
return new class extends Migration
{
    public function getConnection()
    {
        return config('outbox.connection');
    }

    public function up(): void
    {
        Schema::connection($this->getConnection())->create(config('outbox.table', 'outbox'), function (Blueprint $table) {
            $table->uuid('id')->primary();
            $table->string('aggregate_type', 64);
            $table->string('aggregate_id', 64);
            $table->string('topic', 120);
            $table->json('payload');
            $table->bigInteger('version')->nullable();
            $table->enum('status', ['pending', 'published'])->default('pending');
            $table->dateTime('created_at', 6);
            $table->dateTime('published_at', 6)->nullable();

            $table->index(['status', 'created_at'], 'idx_dispatch');  // poll mode's claim
            $table->index('created_at', 'idx_created_at');            // outbox:prune
        });
    }

    public function down(): void
    {
        Schema::connection($this->getConnection())->dropIfExists(config('outbox.table', 'outbox'));
    }
};
