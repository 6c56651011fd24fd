<?php

use Illuminate\Database\Migrations\Migration;
use Illuminate\Database\Schema\Blueprint;
use Illuminate\Support\Facades\Schema;

/*
 * The billing consumer's effect: one line per issued invoice. No unique key on purpose: an
 * effect applied twice would show as two lines (the processed_messages claim prevents it).
 */
return new class extends Migration
{
    public function up()
    {
        Schema::create('ledger', function (Blueprint $table) {
            $table->id();
            $table->uuid('uuid')->unique();
            $table->unsignedBigInteger('invoice_id')->index();
            $table->uuid('event_id');
            $table->text('customer_name');               // sealed again at rest (enc:v1)
            $table->bigInteger('total_cents');
            $table->dateTime('booked_at', 6);
        });
    }

    public function down()
    {
        Schema::dropIfExists('ledger');
    }
};
