//! What the `outboxd` binary's command layer (`src/commands/`, a separate crate root) uses of
//! the library's private modules, one re-export per item. The binary needs these in a release
//! build, so they cannot hide behind `test-util`; listing them here, rather than making their
//! modules `pub`, keeps every other item of those modules private to the library (and the
//! compiler's `unreachable_pub` lint honest about it). Each inner module mirrors the path
//! the commands write (`crate::debezium::offset::parse`), so `main.rs` imports these modules
//! in place of the private ones and the command files read the same. No stability promise.

pub mod db {
    pub mod mysql {
        pub use crate::db::mysql::connect_sql;
    }
    pub mod postgres {
        pub use crate::db::postgres::connect_sql;
    }
}

pub mod debezium {
    pub mod config {
        pub use crate::debezium::config::translate;
    }
    pub mod offset {
        pub use crate::debezium::offset::{parse, DebeziumOffset};
    }
}

pub mod diagnostics {
    pub use crate::diagnostics::{line, CheckLine, Level};
}

pub mod progress {
    pub use crate::progress::{configure, Progress, Unit};
}

pub mod secret_file {
    pub use crate::secret_file::read_string;
}

pub mod values {
    pub use crate::values::parse_bytes;
}
