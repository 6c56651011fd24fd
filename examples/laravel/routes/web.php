<?php

use App\Http\Controllers\InvoiceController;
use Illuminate\Support\Facades\Route;

Route::post('/invoices', [InvoiceController::class, 'store']);
Route::get('/invoices/by-tax-id/{taxId}', [InvoiceController::class, 'byTaxId']);
