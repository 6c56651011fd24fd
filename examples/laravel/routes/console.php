<?php

// The application's commands are in app/Console/Commands; outboxd/laravel adds outbox:*.
