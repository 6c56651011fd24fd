//! outboxd: a transactional outbox relay.
