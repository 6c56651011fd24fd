<?php

// The package's classes through the autoloader Composer generated (composer dump-autoload);
// Laravel and php-amqplib from it too when Composer installed them, else from Debian's
// php-laravel-framework and php-amqplib under /usr/share/php.

$autoload = __DIR__.'/../vendor/autoload.php';
if (! is_file($autoload)) {
    fwrite(STDERR, "No vendor/autoload.php: run composer dump-autoload in php/laravel (scripts/php-autoload.sh does it)\n");
    exit(2);
}
require $autoload;

if (! class_exists(Illuminate\Foundation\Application::class)) {
    foreach (['Illuminate/autoload.php', 'PhpAmqpLib/autoload.php'] as $lib) {
        if (! stream_resolve_include_path($lib)) {
            fwrite(STDERR, "Missing $lib: install Debian's php-laravel-framework and php-amqplib (scripts/services/php.sh)\n");
            exit(2);
        }
        require_once $lib;
    }
}
