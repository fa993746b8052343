//! Wake-ups on the WAL file's changes: how an idle relay learns at once of commits made by other
//! processes (the SQL contract) and other handles, without polling the file many times a second.
//!
//! Every commit, whoever makes it, appends to the WAL file; on Linux, inotify reports each write
//! (`IN_MODIFY`) to a thread that wakes the relay's waiting threads. The relay still checks the
//! file now and then (its safety net: an event lost to a full inotify queue, a file system that
//! reports nothing), and falls back to its poll interval where there is no watch: not Linux, or
//! inotify refused (its per-user limits), or the WAL file went away.

use std::path::Path;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

/// After a change, how often the waiting thread checks whether a commit became visible: often
/// at first, since most commits sync within a few milliseconds of writing their frames...
const RECHECK_SOON: Duration = Duration::from_millis(1);
/// ...for this long after the last change...
const SOON_FOR: Duration = Duration::from_millis(10);
/// ...then at a growing interval, half the time since the last change, at most this: a commit
/// that takes longer to show is found at most half as late again, and a change that never shows
/// costs a few dozen checks, not hundreds...
const RECHECK_MOST: Duration = Duration::from_millis(100);
/// ...until this long after the last change (most commits' fsyncs, even on slow flash)...
const RECHECK_FOR: Duration = Duration::from_secs(1);
/// ...then once a second until this long after it: an fsync stalled behind other writers' I/O
/// can take several seconds, and a commit that shows after the window would otherwise wait for
/// the poll interval, which may be a minute. A change that never shows costs a few dozen more
/// checks, one a second.
const RECHECK_TAIL_EVERY: Duration = Duration::from_secs(1);
const RECHECK_TAIL_FOR: Duration = Duration::from_secs(30);

/// Changes seen in the file, not yet seen as a commit.
///
/// A commit writes its WAL frames (which is what wakes the watch) before it syncs them and
/// publishes them in the shared-memory index (which wakes nobody): a reader woken by the write
/// may find nothing new yet. So after a change the waiting thread checks `PRAGMA data_version`
/// every millisecond at first, then less and less often, until it moves: for a second after the
/// last change, then once a second for half a minute, then it goes back to sleep. Many changes
/// never show as a version the waiting thread can see: its own connection's writes, a rollback
/// whose pages spilled into the WAL, the tail of a commit whose start already showed (its writes
/// can reach the watch in two reads); the growing interval keeps what each of those costs small.
/// Both phases are timed from the last change: writes that keep coming (a busy writer, the
/// relay's own marks during a drain) keep the checks at one a millisecond, one query each, which
/// costs little beside the writes themselves; timing the fast phase from the first change
/// instead left a foreign commit that followed the waiting thread's own writes (which never
/// settle: they move no version its connection can see) waiting 5 ms.
#[derive(Debug, Default)]
pub(crate) struct Unsettled {
    /// When the last change was seen, while it settles.
    since: Option<Instant>,
}

impl Unsettled {
    /// The file changed.
    pub(crate) fn on_change(&mut self) {
        self.on_change_at(Instant::now());
    }

    fn on_change_at(&mut self, now: Instant) {
        self.since = Some(now);
    }

    /// The change became visible (or no longer matters).
    pub(crate) fn settle(&mut self) {
        self.since = None;
    }

    /// If a change is still settling, how soon to check again. Decided in one call: asking
    /// whether a change is settling and then how long to wait could see the window close between
    /// the two, and sleep the long wait where a recheck was meant.
    pub(crate) fn recheck(&mut self) -> Option<Duration> {
        self.recheck_at(Instant::now())
    }

    fn recheck_at(&mut self, now: Instant) -> Option<Duration> {
        let age = now.saturating_duration_since(self.since?);
        let tail_for = if crate::mutant::active("recheck-no-tail") {
            RECHECK_FOR
        } else {
            RECHECK_TAIL_FOR
        };
        if age >= tail_for {
            self.since = None;
            None
        } else if age >= RECHECK_FOR {
            Some(RECHECK_TAIL_EVERY)
        } else if age < SOON_FOR {
            Some(RECHECK_SOON)
        } else if crate::mutant::active("recheck-flat") {
            Some(Duration::from_millis(5))
        } else {
            Some((age / 2).min(RECHECK_MOST))
        }
    }

    /// How long to wait before checking, at most `otherwise`.
    pub(crate) fn wait(&mut self, otherwise: Duration) -> Duration {
        self.recheck().map_or(otherwise, |soon| otherwise.min(soon))
    }
}

/// A running watch; stopped and joined on drop.
pub(crate) struct FileWatch {
    #[cfg(target_os = "linux")]
    inner: linux::Watch,
}

impl FileWatch {
    /// Watches `wal`; each change sends one wake-up to each of `wake` (never blocking: a full
    /// channel already has one pending). `None` where watching is not possible here: the caller
    /// polls instead. When the watch ends on its own, the senders are dropped, which the
    /// receivers see as disconnected.
    pub(crate) fn start(wal: &Path, wake: Vec<Sender<()>>) -> Option<FileWatch> {
        #[cfg(target_os = "linux")]
        {
            linux::Watch::start(wal, wake).map(|inner| FileWatch { inner })
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (wal, wake);
            tracing::debug!(
                "no file notifications on this platform: the relay polls for other processes' commits"
            );
            None
        }
    }
}

#[cfg(target_os = "linux")]
impl Drop for FileWatch {
    fn drop(&mut self) {
        self.inner.stop();
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::path::Path;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::thread::{self, JoinHandle};
    use std::time::Duration;

    use crossbeam_channel::Sender;
    use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};

    /// After waking the relay, the next events are read this much later: a burst of writes (a
    /// busy writer, the relay's own marks) becomes one wake-up, not one per write.
    const COALESCE: Duration = Duration::from_millis(2);

    pub(super) struct Watch {
        stopping: Arc<AtomicBool>,
        watches: Watches,
        wd: WatchDescriptor,
        thread: Option<JoinHandle<()>>,
    }

    impl Watch {
        pub(super) fn start(wal: &Path, wake: Vec<Sender<()>>) -> Option<Watch> {
            let refused = |e: std::io::Error| {
                tracing::info!(file = %wal.display(), error = %e, "cannot watch the WAL file: polling for other processes' commits instead");
            };
            let inotify = Inotify::init().map_err(refused).ok()?;
            let mut watches = inotify.watches();
            let wd = watches.add(wal, WatchMask::MODIFY).map_err(refused).ok()?;
            let stopping = Arc::new(AtomicBool::new(false));
            let thread = {
                let (stopping, wal) = (stopping.clone(), wal.to_path_buf());
                thread::Builder::new()
                    .name("edge-outbox-watch".into())
                    .spawn(move || run(inotify, &wal, &wake, &stopping))
                    .map_err(refused)
                    .ok()?
            };
            Some(Watch {
                stopping,
                watches,
                wd,
                thread: Some(thread),
            })
        }

        pub(super) fn stop(&mut self) {
            self.stopping.store(true, Ordering::SeqCst);
            // Removing the watch queues an IN_IGNORED event: the thread's blocking read returns.
            if self.watches.remove(self.wd.clone()).is_err() {
                // Already gone (the file was removed): the thread has ended or is ending.
            }
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    fn run(mut inotify: Inotify, wal: &Path, wake: &[Sender<()>], stopping: &AtomicBool) {
        let mut buffer = [0u8; 1024];
        loop {
            let gone = match inotify.read_events_blocking(&mut buffer) {
                Ok(events) => events.into_iter().any(|e| e.mask.contains(EventMask::IGNORED)),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(file = %wal.display(), error = %e, "stopped watching the WAL file: polling instead");
                    return;
                }
            };
            if stopping.load(Ordering::SeqCst) {
                return;
            }
            for w in wake {
                let _ = w.try_send(());
            }
            if gone {
                tracing::info!(file = %wal.display(), "the WAL file went away: polling for other processes' commits instead");
                return;
            }
            thread::sleep(COALESCE);
        }
    }
}

/// The database's change counter as this connection sees it: it moves when another connection
/// commits, which is how rows written by other processes are noticed without scanning.
pub(crate) fn data_version(conn: &rusqlite::Connection) -> crate::error::Result<i64> {
    // Cached: a waiting thread asks up to every millisecond after a change.
    Ok(conn
        .prepare_cached("PRAGMA data_version")?
        .query_row([], |r| r.get(0))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settling_change_is_rechecked_soon_then_less_often_and_a_settled_one_not_at_all() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut unsettled = Unsettled::default();
        assert_eq!(unsettled.recheck_at(t0), None);
        unsettled.on_change_at(t0);
        assert_eq!(unsettled.recheck_at(t0), Some(RECHECK_SOON));
        assert_eq!(unsettled.recheck_at(t0 + SOON_FOR - ms(1)), Some(RECHECK_SOON));
        assert_eq!(unsettled.recheck_at(t0 + SOON_FOR), Some(SOON_FOR / 2));
        assert_eq!(unsettled.recheck_at(t0 + ms(60)), Some(ms(30)), "half the age");
        assert_eq!(unsettled.recheck_at(t0 + ms(500)), Some(RECHECK_MOST), "at most");
        // A later change starts both phases again.
        unsettled.on_change_at(t0 + ms(900));
        assert_eq!(unsettled.recheck_at(t0 + ms(901)), Some(RECHECK_SOON));
        assert_eq!(unsettled.recheck_at(t0 + ms(900) + SOON_FOR), Some(SOON_FOR / 2));
        assert_eq!(
            unsettled.recheck_at(t0 + ms(900) + RECHECK_FOR - ms(1)),
            Some(RECHECK_MOST),
            "the window runs from the last change"
        );
        assert_eq!(
            unsettled.recheck_at(t0 + ms(900) + RECHECK_FOR),
            Some(RECHECK_TAIL_EVERY),
            "a commit whose sync stalls past the first second is still found within a second"
        );
        assert_eq!(
            unsettled.recheck_at(t0 + ms(900) + RECHECK_TAIL_FOR - ms(1)),
            Some(RECHECK_TAIL_EVERY)
        );
        assert_eq!(
            unsettled.recheck_at(t0 + ms(900) + RECHECK_TAIL_FOR),
            None,
            "a change that never settles is given up on"
        );
        assert_eq!(unsettled.recheck_at(t0 + ms(900) + RECHECK_TAIL_FOR), None);
        // A new change after giving up, or after settling, starts a new fast phase.
        unsettled.on_change_at(t0 + ms(3000));
        assert_eq!(unsettled.recheck_at(t0 + ms(3001)), Some(RECHECK_SOON));
        unsettled.settle();
        assert_eq!(unsettled.recheck_at(t0 + ms(3002)), None);
        assert_eq!(unsettled.wait(Duration::from_secs(10)), Duration::from_secs(10));
        unsettled.on_change();
        assert_eq!(unsettled.wait(Duration::from_secs(10)), RECHECK_SOON);
        // A change that never shows: a few dozen checks, the last within a check of the end.
        let mut at = t0 + ms(5000);
        unsettled.on_change_at(at);
        let mut checks = 0;
        while let Some(next) = unsettled.recheck_at(at) {
            at += next;
            checks += 1;
        }
        assert!((50..=70).contains(&checks), "{checks} checks");
        assert!(
            at >= t0 + ms(5000) + RECHECK_TAIL_FOR
                && at <= t0 + ms(5000) + RECHECK_TAIL_FOR + RECHECK_TAIL_EVERY
        );
        assert_eq!(
            unsettled.wait(Duration::from_micros(200)),
            Duration::from_micros(200)
        );
    }
}
