//! The handler thread: applies stored commands one at a time, woken when one arrives.
//!
//! It has its own connection and never touches the application's: the write lock is held only
//! while the handler's database step runs (see `store::apply`), so the application keeps
//! committing while a two-phase handler's outside step is slow.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvError, TryRecvError, select};
use rusqlite::Connection;

use crate::error::Result;
use crate::mqtt::backoff::Backoff;
use crate::mqtt::status::{Source, StatusCell};
use crate::store::watch::{Unsettled, data_version};
use crate::store::{
    Applier, ApplyOutcome, Command, Outbox, RELAY_OWNER, Tx, connect, recover_relay_attempts, run_next,
};

/// A command handler as the thread runs it: one claim, act, record cycle on its connection.
pub(crate) trait Apply: Send {
    fn apply_next(
        &mut self,
        conn: &mut Connection,
        applier: &Applier<'_>,
        on_claim: &mut dyn FnMut(&Command),
    ) -> Result<(ApplyOutcome, u64)>;
}

/// A handler as the user gave it: `act` outside any transaction (a no-op for one-phase handlers),
/// `record` in the transaction that marks the command applied.
pub(crate) struct TwoPhase<A, R> {
    pub act: A,
    pub record: R,
}

impl<P, EA, ER, A, R> Apply for TwoPhase<A, R>
where
    A: FnMut(&Command) -> std::result::Result<P, EA> + Send,
    EA: std::fmt::Display + 'static,
    R: FnMut(&mut Tx<'_>, &Command, P) -> std::result::Result<(), ER> + Send,
    ER: std::fmt::Display + 'static,
{
    fn apply_next(
        &mut self,
        conn: &mut Connection,
        applier: &Applier<'_>,
        on_claim: &mut dyn FnMut(&Command),
    ) -> Result<(ApplyOutcome, u64)> {
        run_next(
            conn,
            applier,
            on_claim,
            |cmd| (self.act)(cmd),
            |tx, cmd, p| (self.record)(tx, cmd, p),
        )
    }
}

pub(crate) type Handler = Box<dyn Apply>;

/// Commands stored by another process are noticed within this interval where the file is not
/// watched...
const SAFETY_POLL: Duration = Duration::from_secs(1);
/// ...and where it is (a change wakes the thread at once), this is the safety net.
const WATCHED_POLL: Duration = Duration::from_secs(10);

pub(crate) fn run_handler(
    outbox: Outbox,
    mut handler: Handler,
    mut arrivals: Receiver<()>,
    changes: Option<Receiver<()>>,
    stop: Receiver<()>,
    status: Arc<StatusCell>,
) -> Result<()> {
    let (mut changes, mut poll) = match changes {
        Some(rx) => (rx, WATCHED_POLL),
        None => (crossbeam_channel::never(), SAFETY_POLL),
    };
    // After a change: wait for the commit to become visible before trying again.
    let mut unsettled = Unsettled::default();
    let mut version: Option<i64> = None;
    // When the earliest command waiting out its backoff falls due: a recheck wait ends then.
    let mut due_at: Option<Instant> = None;
    let options = outbox.options().clone();
    let stranded = std::sync::Mutex::new(Vec::new());
    let applier = Applier {
        options: &options,
        owner: RELAY_OWNER,
        stranded: &stranded,
        path: outbox.canonical_path(),
    };
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
    let mut conn: Option<Connection> = None;
    loop {
        if stop.try_recv() != Err(TryRecvError::Empty) {
            return Ok(());
        }
        let data_version = |conn: &Option<Connection>| conn.as_ref().and_then(|c| data_version(c).ok());
        if let Some(recheck) = unsettled.recheck() {
            // Try at once after a change, then again each time another commit shows. The
            // rechecks grow sparse as the change ages, so this wait also hears a command stored
            // by the intake, another change, and a retry falling due.
            let now = data_version(&conn);
            let due = due_at.is_some_and(|at| Instant::now() >= at);
            if !due && now.is_some() && now == version {
                let until_due = due_at.map_or(recheck, |at| at.saturating_duration_since(Instant::now()));
                select! {
                    recv(stop) -> _ => return Ok(()),
                    // Committed before it was sent: try at once.
                    recv(arrivals) -> arrival => if received(arrival, &mut arrivals) {
                        version = None;
                    },
                    recv(changes) -> change => if watch_event(change, &mut changes, &mut poll) {
                        unsettled.on_change();
                    },
                    default(recheck.min(until_due)) => {}
                }
                continue;
            }
            if version.is_some() && now != version {
                // The commit became visible: the next change starts a new fast recheck.
                unsettled.settle();
            }
            version = now;
        }
        let step = ready(&mut conn, &outbox, &status).and_then(|conn| {
            handler.apply_next(conn, &applier, &mut |cmd| status.set_applying(Some(cmd.id)))
        });
        status.set_applying(None);
        let wait = match step {
            Ok((outcome, recovered_dead)) => {
                status.clear_error(Source::Applying);
                status.on_commands_dead_lettered(recovered_dead);
                match outcome {
                    ApplyOutcome::Idle { next_due } => {
                        due_at = next_due.map(|d| Instant::now() + d);
                        next_due.map_or(poll, |d| d.min(poll))
                    }
                    outcome => {
                        // Its own commit moves no data version it can see: try the next command
                        // at once, not after the recheck window.
                        version = None;
                        due_at = None;
                        match &outcome {
                            ApplyOutcome::Applied { published, .. } => {
                                status.on_applied();
                                if *published > 0 {
                                    outbox.wake_relay();
                                }
                            }
                            ApplyOutcome::Rejected { .. } => status.on_rejected(),
                            ApplyOutcome::DeadLettered { .. } => status.on_commands_dead_lettered(1),
                            _ => {}
                        }
                        backoff.reset();
                        continue;
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "applying commands failed; retrying");
                status.set_error(Source::Applying, format!("applying commands: {e}"));
                backoff.next_delay()
            }
        };
        select! {
            recv(arrivals) -> arrival => {
                received(arrival, &mut arrivals);
            }
            recv(changes) -> change => if watch_event(change, &mut changes, &mut poll) {
                version = None;
                unsettled.on_change();
            },
            recv(stop) -> _ => return Ok(()),
            default(unsettled.wait(wait)) => {}
        }
    }
}

/// Whether a wait's channel sent something. A closed one (its sender's thread ended: the relay
/// stopping, or a bug) would otherwise wake every later wait at once: it is replaced by one that
/// never sends.
fn received(message: Result<(), RecvError>, channel: &mut Receiver<()>) -> bool {
    if message.is_ok() {
        return true;
    }
    *channel = crossbeam_channel::never();
    false
}

/// What the file watch sent: `true` for a change. When the watch ended, the thread polls from
/// then on as if there had never been one.
fn watch_event(change: Result<(), RecvError>, changes: &mut Receiver<()>, poll: &mut Duration) -> bool {
    if received(change, changes) {
        return true;
    }
    *poll = SAFETY_POLL;
    false
}

/// The thread's connection, opened on first use (and after a failure to open), after recovering
/// the attempts a previous relay's handler left running: the relay lock says it is gone.
fn ready<'c>(
    conn: &'c mut Option<Connection>,
    outbox: &Outbox,
    status: &StatusCell,
) -> Result<&'c mut Connection> {
    if conn.is_none() {
        let mut opened = connect(outbox.path(), outbox.options())?;
        let dead = recover_relay_attempts(&mut opened, outbox.options())?;
        status.on_commands_dead_lettered(dead);
        *conn = Some(opened);
    }
    conn.as_mut()
        .ok_or_else(|| crate::Error::Panicked("edge-outbox-handler (no connection)".into()))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// A handler with nothing to apply that counts how often the thread asks it.
    struct Counting(Arc<AtomicU64>);

    impl Apply for Counting {
        fn apply_next(
            &mut self,
            _conn: &mut Connection,
            _applier: &Applier<'_>,
            _on_claim: &mut dyn FnMut(&Command),
        ) -> Result<(ApplyOutcome, u64)> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok((ApplyOutcome::Idle { next_due: None }, 0))
        }
    }

    /// The command intake's thread ends (a panic in it, or the relay stopping): its end of the
    /// arrivals channel closes. That is not a command arriving, over and over: the handler keeps
    /// to its polls instead of asking for the next command at full speed until the relay stops.
    #[test]
    fn a_closed_arrivals_channel_is_not_an_arrival() {
        let dir = tempfile::tempdir().expect("temp dir");
        let outbox = Outbox::open(dir.path().join("device.db")).expect("outbox");
        let (intake, arrivals) = crossbeam_channel::bounded(1);
        drop(intake);
        let (stop_tx, stop) = crossbeam_channel::bounded::<()>(0);
        let calls = Arc::new(AtomicU64::new(0));
        let handler = Box::new(Counting(calls.clone()));
        let thread = std::thread::spawn(move || {
            run_handler(outbox, handler, arrivals, None, stop, Arc::new(StatusCell::new()))
        });
        // Shorter than the unwatched poll: one ask at start, and one when the closed channel
        // first wakes the thread.
        std::thread::sleep(SAFETY_POLL / 2);
        assert!(
            !thread.is_finished(),
            "the handler thread ended with the intake's"
        );
        drop(stop_tx);
        thread.join().expect("handler thread").expect("handler result");
        let asked = calls.load(Ordering::SeqCst);
        assert!(
            (1..=2).contains(&asked),
            "asked for the next command {asked} times"
        );
    }
}
