//! The handler thread: applies stored commands one at a time, woken when one arrives.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, TryRecvError, select};

use crate::error::Result;
use crate::mqtt::backoff::Backoff;
use crate::mqtt::status::StatusCell;
use crate::store::{ApplyOutcome, Command, Outbox, Tx};

/// A command handler: the effect of one command, run in the transaction that marks it applied.
pub(crate) type Handler = Box<dyn FnMut(&mut Tx<'_>, &Command) -> std::result::Result<(), String> + Send>;

/// Commands stored by another process are noticed within this interval.
const SAFETY_POLL: Duration = Duration::from_secs(1);

pub(crate) fn run_handler(
    outbox: Outbox,
    mut handler: Handler,
    arrivals: Receiver<()>,
    stop: Receiver<()>,
    status: Arc<StatusCell>,
) -> Result<()> {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
    loop {
        if stop.try_recv() != Err(TryRecvError::Empty) {
            return Ok(());
        }
        let wait = match outbox.apply_next(|tx, cmd| handler(tx, cmd)) {
            Ok(ApplyOutcome::Idle { next_due }) => next_due.map_or(SAFETY_POLL, |d| d.min(SAFETY_POLL)),
            Ok(outcome) => {
                if matches!(outcome, ApplyOutcome::Applied { .. }) {
                    status.on_applied();
                }
                backoff.reset();
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "applying commands failed; retrying");
                status.set_error(format!("applying commands: {e}"));
                backoff.next_delay()
            }
        };
        select! {
            recv(arrivals) -> _ => {}
            recv(stop) -> _ => return Ok(()),
            default(wait) => {}
        }
    }
}
