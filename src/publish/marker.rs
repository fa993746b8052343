//! The marker: a thread with its own connection that marks acknowledged rows (deletes them, or
//! moves them to `outbox_sent`), so that the publisher never waits for a write.
//!
//! Marking was a large share of the publisher's time in a backlog drain, and SQLite runs its
//! checkpoints inside the commit that takes the WAL past its limit, a pause every few thousand
//! rows (`cargo bench --bench relay` measures the drain). While the publisher marked, PUBACKs queued
//! and the in-flight window ran dry.
//! Here marks and checkpoints only delay marks: the publisher hands over each batch of
//! acknowledged sequence numbers and goes back to keeping the window full.
//!
//! A row is still never marked before its PUBACK: only acknowledged numbers are sent here. Before
//! the publisher reads the outbox again from its oldest row (after a reconnect), it waits until
//! every batch handed over is marked ([`Marks::sync`]), so that nothing acknowledged is published
//! again needlessly.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use rusqlite::Connection;

use super::rows;
use crate::error::Result;
use crate::mqtt::status::{Source, StatusCell};
use crate::store::Options;
use crate::store::published::Watermark;

/// What the publisher sends the marker.
pub(crate) enum Mark {
    /// Acknowledged rows, by sequence number.
    Acked(Vec<i64>),
    /// Gap rows whose notices are acknowledged, as `seq` ranges.
    Announced(Vec<(i64, i64)>),
    /// Reply once every batch sent before this one was marked (or failed to be).
    Sync(Sender<()>),
}

/// After a failed mark, try again this long after.
const RETRY: Duration = Duration::from_millis(200);

/// The publisher's handle on the marker thread.
pub(crate) struct Marks {
    tx: Sender<Mark>,
    /// Batches of acknowledged rows the marker has committed, counted from the start.
    marked: Arc<AtomicU64>,
}

impl Marks {
    /// A handle on the marker reading `rx` of `tx`; `marked` is the marker's
    /// [`Marker::marked`].
    pub(crate) fn new(tx: Sender<Mark>, marked: Arc<AtomicU64>) -> Self {
        Marks { tx, marked }
    }

    /// How many non-empty batches handed over (by [`Marks::send`] and [`Marks::sync`]) are
    /// marked: the rest may still be unmarked.
    pub(crate) fn marked(&self) -> u64 {
        self.marked.load(Ordering::Acquire)
    }

    /// Hands `acked` over (and leaves it empty). False if the marker thread is gone.
    pub(crate) fn send(&self, acked: &mut Vec<i64>) -> bool {
        if acked.is_empty() {
            return true;
        }
        // A copy of exactly its length: batches queue up while the marker waits for the disk, and
        // each must not carry the full capacity `acked` grew to (measured: several MiB of RSS).
        let batch = acked.as_slice().to_vec();
        acked.clear();
        self.tx.send(Mark::Acked(batch)).is_ok()
    }

    /// Hands over gap ranges whose notices were acknowledged (and leaves `ranges` empty).
    pub(crate) fn send_announced(&self, ranges: &mut Vec<(i64, i64)>) -> bool {
        if ranges.is_empty() {
            return true;
        }
        self.tx.send(Mark::Announced(std::mem::take(ranges))).is_ok()
    }

    /// Hands `acked` over and waits until every batch so far is marked (or failed to be).
    pub(crate) fn sync(&self, acked: &mut Vec<i64>) {
        let (reply_tx, reply_rx) = crossbeam_channel::bounded(1);
        if self.send(acked) && self.tx.send(Mark::Sync(reply_tx)).is_ok() {
            let _ = reply_rx.recv();
        }
    }
}

pub(crate) struct Marker {
    pub conn: Connection,
    pub options: Options,
    pub status: Arc<StatusCell>,
    pub rx: Receiver<Mark>,
    /// How far the cloud has the numbers (beside the file): a backup restored in place is told
    /// by its counter being behind it.
    pub watermark: Watermark,
    /// Batches of acknowledged rows committed so far (see [`Marks::marked`]).
    pub marked: Arc<AtomicU64>,
}

impl Marker {
    /// Marks batches as they come, several at a time in one transaction when they queue up,
    /// until the publisher is gone and everything it sent is marked (or failed twice).
    pub(crate) fn run(mut self) -> Result<()> {
        let mut pending: Vec<i64> = Vec::new();
        let mut batches = 0u64;
        let mut announced: Vec<(i64, i64)> = Vec::new();
        let mut replies: Vec<Sender<()>> = Vec::new();
        let mut open = true;
        let mut failed = false;
        while open || ((!pending.is_empty() || !announced.is_empty()) && !failed) {
            // Wait for work; after a failure, retry what is pending a little later anyway.
            let first = if !open {
                None
            } else if pending.is_empty() && announced.is_empty() {
                let m = self.rx.recv().ok();
                open = m.is_some();
                m
            } else {
                match self.rx.recv_timeout(RETRY) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => {
                        open = false;
                        None
                    }
                }
            };
            let mut next = first;
            loop {
                match next.take() {
                    Some(Mark::Acked(batch)) => {
                        pending.extend(batch);
                        batches += 1;
                    }
                    Some(Mark::Announced(ranges)) => announced.extend(ranges),
                    Some(Mark::Sync(reply)) => replies.push(reply),
                    None => {}
                }
                match self.rx.try_recv() {
                    Ok(m) => next = Some(m),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            if !pending.is_empty() {
                let high = pending.iter().copied().max();
                match rows::mark_acked(&mut self.conn, &self.options, &mut pending) {
                    Ok(()) => {
                        pending.clear();
                        self.marked
                            .fetch_add(std::mem::take(&mut batches), Ordering::Release);
                        if let Some(high) = high {
                            self.watermark.raise(high);
                        }
                        failed = false;
                        self.status.clear_error(Source::Marking);
                    }
                    // Keep them and retry: an unmarked row is only ever published again, never
                    // lost. With the publisher gone, one more try, then they wait for next time.
                    Err(e) => {
                        tracing::error!(error = %e, rows = pending.len(), "could not mark acknowledged rows");
                        self.status
                            .set_error(Source::Marking, format!("marking acknowledged rows: {e}"));
                        failed = !open;
                    }
                }
            }
            if !announced.is_empty() {
                match super::gaps::mark_announced(&mut self.conn, &self.options, &announced) {
                    Ok(()) => {
                        if let Some(high) = announced.iter().map(|&(_, last)| last).max() {
                            self.watermark.raise(high);
                        }
                        announced.clear();
                    }
                    // Kept and retried: a notice not marked is only published again (same id).
                    Err(e) => {
                        tracing::error!(error = %e, "could not mark announced gaps");
                        self.status
                            .set_error(Source::Marking, format!("marking announced gaps: {e}"));
                        failed = !open;
                    }
                }
            }
            for reply in replies.drain(..) {
                let _ = reply.send(());
            }
        }
        self.watermark.sync();
        Ok(())
    }
}
