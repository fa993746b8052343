//! `<db>.relay-status.json`: what a running relay reports to other processes. The library writes
//! it (`RelayConfig::status_file`, always on for `edge-outbox relay`) and reads it
//! ([`RelayReport::read`]); this module is where the CLI's commands get it from.

use std::path::Path;

pub use edge_outbox::RelayReport;

/// The last report, if there is a readable one.
pub fn read(db: &Path) -> Option<RelayReport> {
    RelayReport::read(db)
}
