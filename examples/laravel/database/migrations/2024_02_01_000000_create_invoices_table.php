<?php

use Illuminate\Database\Migrations\Migration;
use Illuminate\Database\Schema\Blueprint;
use Illuminate\Support\Facades\Schema;

return new class extends Migration
{
    public function up()
    {
        Schema::create('invoices', function (Blueprint $table) {
            $table->id();
            $table->uuid('uuid')->unique();              // what the sealed columns are bound to
            $table->string('number', 32)->unique();
            $table->text('customer_name');               // sealed (enc:v1)
            $table->text('tax_id');                      // sealed (enc:v1)
            $table->string('tax_id_index', 64);          // blind index: equality search without a clear copy
            $table->string('tax_id_index_key', 32);      // the blind-index key it was computed under
            $table->bigInteger('total_cents');
            $table->dateTime('issued_at', 6);

            $table->index(['tax_id_index_key', 'tax_id_index']);
        });
    }

    public function down()
    {
        Schema::dropIfExists('invoices');
    }
};
