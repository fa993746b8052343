//! `edge-outbox metrics`: the store's figures, and the running relay's if it reports, in the
//! Prometheus text format on stdout (for a scraper, a cron job writing node_exporter's textfile
//! directory, or a look by hand). Read-only, like `status`.

use crate::relay_probe::{self, Probe};
use crate::status_file;
use crate::{Global, Result, db, output};

pub fn run(global: &Global) -> Result<()> {
    let path = db::path(global)?;
    let conn = db::open_read(global, &path)?;
    let stats = edge_outbox::Stats::read(&conn).map_err(|e| db::library_error(&path, e))?;
    drop(conn);
    // The relay's counters only while it runs and its report is current.
    let report = status_file::read(&path).filter(|r| {
        r.is_fresh()
            && match relay_probe::probe(&path) {
                Probe::Running { pid: Some(pid) } => r.pid == pid,
                Probe::Running { pid: None } | Probe::Unknown(_) => true,
                Probe::NotRunning => false,
            }
    });
    output::print(&edge_outbox::metrics::encode(&stats, report.as_ref()))
}
