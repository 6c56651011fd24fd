//! The user-facing surface that needs little or no service: the docs against `--help`,
//! packaging, the library's public surface, the fuzz corpus replay, the config file, the
//! quickstart, docker-compose, and no secret in any command's output.

#[path = "../common/mod.rs"]
mod common;

mod compose;
mod config_file;
mod docs;
mod fuzz_corpus;
mod layout;
mod packaging;
mod public;
mod quickstart;
mod secrets;
mod tour;
