//! The reporter thread: writes the relay's status file (and its metrics file) when something
//! changes, and at a heartbeat.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, select};
use rusqlite::Connection;

use crate::error::{Error, Result};
use crate::mqtt::status::StatusCell;
use crate::report::{HEARTBEAT, Identity, MIN_INTERVAL, RelayReport, remove, report, write_atomically};
use crate::store::Stats;
use crate::time::now_ms;

/// The reporter thread: writes the status file (and the metrics file) on change.
pub(crate) struct Reporter {
    pub db: PathBuf,
    pub conn: Connection,
    pub identity: Identity,
    pub status: Arc<StatusCell>,
    pub status_file: bool,
    pub metrics_file: Option<PathBuf>,
    /// Read only where the metrics are written (feature `metrics`).
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub metrics_file_mode: u32,
    pub stop: Receiver<()>,
}

impl Reporter {
    pub(crate) fn run(self) -> Result<()> {
        let changes = self.status.changes();
        let status_path = RelayReport::path(&self.db);
        let mut last: Option<(RelayReport, Stats)> = None;
        let mut last_write = Instant::now();
        let mut failed = false;
        loop {
            self.status.take_change();
            match self.write(&status_path, &mut last, last_write.elapsed() >= HEARTBEAT) {
                Ok(true) => {
                    last_write = Instant::now();
                    failed = false;
                }
                Ok(false) => {}
                Err(e) if !failed => {
                    failed = true;
                    tracing::warn!(error = %e, "cannot write the relay's status or metrics file");
                }
                Err(_) => {}
            }
            let heartbeat = HEARTBEAT.saturating_sub(last_write.elapsed());
            select! {
                recv(changes) -> _ => {}
                recv(self.stop) -> _ => break,
                default(heartbeat) => {}
            }
            // Changes that come close together make one write.
            if self.stop.recv_timeout(MIN_INTERVAL) != Err(RecvTimeoutError::Timeout) {
                break;
            }
        }
        if self.status_file {
            remove(&status_path);
        }
        if let Some(path) = &self.metrics_file {
            remove(path);
        }
        Ok(())
    }

    /// Writes the files if something changed since `last` (or `force`); true if it wrote.
    fn write(
        &self,
        status_path: &Path,
        last: &mut Option<(RelayReport, Stats)>,
        force: bool,
    ) -> Result<bool> {
        let stats = Stats::read(&self.conn)?;
        let mut report = report(
            &self.identity,
            &self.status.snapshot(stats.clone()),
            self.status.wal_syncs(),
        );
        let unchanged = last.as_ref().is_some_and(|(r, st)| {
            let mut r = r.clone();
            r.written_at_ms = report.written_at_ms;
            r.process_write_bytes = report.process_write_bytes;
            r == report && same_stats(st, &stats)
        });
        if unchanged && !force {
            return Ok(false);
        }
        report.written_at_ms = now_ms();
        if self.status_file {
            let json = serde_json::to_vec_pretty(&report).map_err(|e| Error::Encode(e.to_string()))?;
            write_atomically(status_path, &json, 0o600)
                .map_err(|e| Error::io(format!("writing {}", status_path.display()), e))?;
        }
        #[cfg(feature = "metrics")]
        if let Some(path) = &self.metrics_file {
            let text = crate::metrics::encode(&stats, Some(&report));
            write_atomically(path, text.as_bytes(), self.metrics_file_mode)
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        }
        *last = Some((report, stats));
        Ok(true)
    }
}

/// The stats, the oldest message's age aside (it grows by itself: not a change).
fn same_stats(a: &Stats, b: &Stats) -> bool {
    let mut a = a.clone();
    a.oldest_pending_age = b.oldest_pending_age;
    a == *b
}
