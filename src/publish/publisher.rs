//! The publisher thread: the driver of the publishing core (see [`super::core`]). It owns the
//! SQLite connection, the MQTT client, the marker's channel and the status, feeds the core what
//! happens (connections, rumqttc's packet events, PUBACKs, changes to the file, the time), and
//! performs the actions the core returns. Every decision about rows is the core's.
//!
//! What stays here is what only a thread with a database can do: the durability barrier in front
//! of publishing, cleanup slices, the integrity check, and the uptime clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, select};
use rumqttc::QoS;
use rusqlite::Connection;

use super::core::{Action, Core, Outgoing, ReadRequest, ReadResult, Removal, Report};
use super::durability::Barrier;
use super::marker::Marks;
use super::new_rows::NewRows;
use super::reader::{self, Context};
use super::rows;
use crate::error::Result;
use crate::mqtt::Extra;
use crate::mqtt::MqttClient;
use crate::mqtt::driver::{Link, SessionHandle, Signal};
use crate::mqtt::event::Event;
use crate::mqtt::status::{Source, StatusCell};
use crate::relay_config::RelayConfig;
use crate::store::Options;
use crate::store::epoch::Epochs;
use crate::store::uptime::UptimeClock;
use crate::store::watch::{Unsettled, data_version};

pub(crate) struct Publisher {
    pub conn: Connection,
    pub marks: Marks,
    pub barrier: Barrier,
    /// Rows up to this number were committed durably by the application's handle (FULL).
    pub durable_seq: Arc<AtomicI64>,
    pub options: Options,
    pub config: RelayConfig,
    /// The connection's signals, in order, one batch per network read (see `crate::relay`).
    pub events: Receiver<Vec<Signal>>,
    pub session: Arc<SessionHandle>,
    pub wake: Receiver<()>,
    /// Changes to the file by anyone (see `crate::store::watch`); `None` where it is not watched.
    pub changes: Option<Receiver<()>>,
    pub stop: Receiver<()>,
    pub status: Arc<StatusCell>,
}

/// The driver's own state: what the core does not decide.
struct Driver {
    core: Core,
    client: Option<MqttClient>,
    /// Which epoch each row is numbered in (read at start: epochs change only when a store is
    /// opened).
    epochs: Epochs,
    /// Every row up to this sequence number is known to be on stable storage (a durability
    /// barrier committed after it). Kept across reconnects.
    durable_through: i64,
    /// A failed read's error is in the status: clear it after the next successful read.
    read_error: bool,
    data_version: i64,
    /// The file changed and the commit may not be visible yet: check `data_version` soon.
    unsettled: Unsettled,
    /// Whether another connection's commit brought anything to read.
    new_rows: NewRows,
    stopping: Option<Instant>,
    next_prune: Instant,
    next_check: Instant,
    /// The time this relay runs, written forward into the file (retention's second clock).
    uptime: UptimeClock,
}

/// Queued events are taken without a `select!`, but at most this many in a row, so that stop and
/// wake-ups are still seen.
const EVENT_BURST: usize = 64;
/// With the file watched, an idle relay still checks it this often (or at its poll interval, if
/// longer): the safety net for a change the watch missed.
const SAFETY_POLL: Duration = Duration::from_secs(2);
/// One slice of cleanup takes at most this long; the next slice follows after `PRUNE_PAUSE`.
const PRUNE_SLICE: Duration = Duration::from_millis(25);
const PRUNE_PAUSE: Duration = Duration::from_millis(250);

impl Publisher {
    pub(crate) fn run(mut self) -> Result<()> {
        let now = Instant::now();
        let mut d = Driver {
            core: Core::new(self.config.clone()),
            client: None,
            epochs: Epochs::read(&self.conn)?,
            durable_through: 0,
            read_error: false,
            data_version: data_version(&self.conn)?,
            unsettled: Unsettled::default(),
            new_rows: NewRows::default(),
            stopping: None,
            next_prune: now + self.config.prune_interval,
            next_check: now + self.config.integrity_interval,
            uptime: UptimeClock::start(&self.options),
        };
        let mut stop = self.stop.clone();
        let (mut changes, mut poll) = match self.changes.take() {
            Some(rx) => (rx, self.config.poll_interval.max(SAFETY_POLL)),
            None => (crossbeam_channel::never(), self.config.poll_interval),
        };
        let mut burst = 0;
        loop {
            crate::failpoint::hit("relay-loop");
            self.status.beat();
            d.core.on_marked(self.marks.marked());
            self.drive(&mut d);
            if let Some(mut acked) = d.core.acks_due(self.events.is_empty()) {
                self.hand_over_acks(&mut acked);
            }
            if let Some(deadline) = d.stopping
                && (d.core.in_flight() == 0 || !d.core.is_connected() || Instant::now() >= deadline)
            {
                break;
            }
            if Instant::now() >= self.next_timer(&d) {
                self.on_tick(&mut d);
            }
            if burst < EVENT_BURST
                && let Ok(signals) = self.events.try_recv()
            {
                burst += 1;
                self.handle_all(&mut d, signals);
                continue;
            }
            burst = 0;
            // The connection thread checks for reconnect requests often only while one may come.
            self.session
                .set_watching(d.core.in_flight() > 0 || d.core.is_paused());
            let idle_wait = match d.stopping {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => d.unsettled.wait(poll),
            }
            .min(self.next_timer(&d).saturating_duration_since(Instant::now()));
            select! {
                recv(self.events) -> signals => match signals {
                    Ok(signals) => self.handle_all(&mut d, signals),
                    // The connection thread ended (shutdown, or it failed): nothing more will come.
                    Err(_) => break,
                },
                recv(self.wake) -> _ => d.core.on_change(),
                recv(changes) -> change => match change {
                    Ok(()) => {
                        if d.new_rows.appeared(&self.conn) {
                            d.core.on_change();
                        }
                        d.unsettled.on_change();
                    }
                    // The watch ended: poll as if there had never been one.
                    Err(_) => {
                        changes = crossbeam_channel::never();
                        poll = self.config.poll_interval;
                        d.core.on_change();
                    }
                },
                recv(stop) -> _ => {
                    tracing::info!(in_flight = d.core.in_flight(), "relay stopping");
                    d.stopping = Some(Instant::now() + self.config.shutdown_timeout);
                    d.core.stop();
                    stop = crossbeam_channel::never();
                }
                default(idle_wait) => self.on_idle(&mut d),
            }
        }
        // What the core still holds: the last PUBACKs' rows, a notice's range.
        d.core.stop();
        self.drive(&mut d);
        let mut acked = d.core.acks_due(true).unwrap_or_default();
        self.marks.sync(&mut acked);
        if let Err(e) = d.uptime.advance(&self.conn, true) {
            tracing::warn!(error = %e, "could not write the uptime clock forward");
        }
        if let Some(client) = &d.client {
            // A clean DISCONNECT: the broker discards the last will, so `offline` is not sent
            // for a planned stop (the status topic gets it published explicitly instead).
            if let Some(topic) = self.config.mqtt.status() {
                let _ = client.try_publish(topic, QoS::AtLeastOnce, true, "offline", Extra::default());
            }
            let _ = client.try_disconnect();
        }
        self.status.set_connected(false);
        Ok(())
    }

    /// Performs the core's actions until it has none. The clocks are read again only after an
    /// action that may take a while (a read, a write, a WAL sync): a hand-over to rumqttc takes
    /// a moment, and a backlog hands over a window's worth in one go.
    fn drive(&mut self, d: &mut Driver) {
        let mut now = (Instant::now(), crate::time::now_ms());
        while let Some(action) = d.core.poll(now.0, now.1) {
            let quick = matches!(action, Action::Publish(_));
            self.perform(d, action);
            if !quick {
                now = (Instant::now(), crate::time::now_ms());
            }
        }
    }

    fn perform(&mut self, d: &mut Driver, action: Action) {
        match action {
            Action::Publish(mut p) => {
                let envelope = std::mem::take(&mut p.envelope);
                let queued = d.client.as_ref().is_some_and(|c| {
                    let extra = Extra {
                        alias: p.alias,
                        expiry: p.expiry,
                        routing: p.routing.as_deref(),
                        json: self.config.format().is_json(),
                    };
                    c.try_publish(&p.topic, QoS::AtLeastOnce, false, envelope, extra)
                        .is_ok()
                });
                if queued {
                    self.handed_over(&p);
                } else {
                    // The request channel is sized above the window, so this means the
                    // connection is gone; the row stays in the outbox for the next one.
                    tracing::debug!("could not hand a publish to rumqttc: the connection is ending");
                    d.client = None;
                    d.core.on_hand_over_failed(p);
                }
            }
            Action::Read(req) => match self.read(d, &req) {
                Ok(read) => {
                    if std::mem::take(&mut d.read_error) {
                        self.status.clear_error(Source::Reading);
                    }
                    d.core.on_read(read);
                }
                Err(e) => self.read_failed(d, &e),
            },
            Action::Claim(seqs) => match rows::claim(&mut self.conn, &seqs) {
                Ok(gone) => d.core.on_claimed(&seqs, &gone),
                Err(e) => self.read_failed(d, &e),
            },
            Action::MarkAll(mut acked) => self.marks.sync(&mut acked),
            Action::Announced(mut ranges) => {
                if !self.marks.send_announced(&mut ranges) {
                    tracing::error!("the marker thread is gone; announced gaps stay recorded");
                }
            }
            Action::DeadLetter(bad, why) => match rows::dead_letter(&mut self.conn, &bad) {
                Ok(()) => {
                    d.core.on_change();
                    self.status.on_dead_lettered(bad.len());
                    match why {
                        Removal::Refused => self.status.on_refused(bad.len()),
                        Removal::Poison => self.status.on_isolated(),
                        Removal::Unpublishable => {}
                    }
                }
                // The rows stay in the outbox and are published again (after the next
                // reconnect); a poison row's strikes start over.
                Err(e) => tracing::error!(error = %e, rows = bad.len(), ?why, "could not dead-letter rows"),
            },
            Action::Expire(mut seqs) => {
                match rows::expire(&mut self.conn, &mut seqs) {
                    Ok(n) => self.status.on_expired(n),
                    // They stay, and are found expired again on the next read.
                    Err(e) => tracing::error!(error = %e, "could not remove expired rows"),
                }
                d.core.on_change();
            }
            Action::Renew(cause) => self.session.request_reconnect(cause),
            Action::Report(report) => self.report(report),
        }
    }

    /// Reads what the core asks for, and syncs the WAL once for it where its commits may not be
    /// on stable storage yet.
    fn read(&mut self, d: &mut Driver, req: &ReadRequest) -> Result<ReadResult> {
        // The schemas' check and the read see one snapshot.
        let snapshot = reader::Snapshot::begin(&self.conn)?;
        #[cfg(feature = "schemas")]
        if let Some(registry) = crate::payload_schema::reloaded(&self.conn, &self.options.limits.schemas) {
            self.options.limits.schemas = Arc::new(registry);
        }
        let ctx = Context {
            source: &self.config.source,
            epochs: &d.epochs,
            allow_dollar: self.options.limits.dollar_topics_allowed(),
            cloud: self.options.limits.cloud_rules(),
            routing: self.config.routing_placement(),
            format: self.config.format(),
            ttl: &self.config.ttl,
            #[cfg(feature = "schemas")]
            schemas: Some(&self.options.limits.schemas),
        };
        let read = reader::read(&self.conn, &ctx, req)?;
        drop(snapshot);
        if let Some(last) = read.last_seq()
            && last > d.durable_through
        {
            // A FULL commit through the application's handle synced the WAL after these rows.
            d.durable_through = d.durable_through.max(self.durable_seq.load(Ordering::Acquire));
        }
        if let Some(last) = read.last_seq()
            && last > d.durable_through
        {
            // Whoever wrote these rows, and with whatever `synchronous` setting, their commit
            // may not be on stable storage yet (a NORMAL writer's is not until the WAL is
            // synced). Publishing it first could announce a change that a power cut then erases:
            // sync the WAL once for everything read. What was read was committed before it.
            // (See super::durability.)
            let high = self.barrier.sync(&self.conn)?;
            self.status.on_wal_sync();
            d.durable_through = high.max(last);
        }
        Ok(read)
    }

    fn read_failed(&self, d: &mut Driver, e: &crate::Error) {
        // Transient (busy, I/O): try again at the next idle tick, not in a tight loop.
        tracing::warn!(error = %e, "could not read the outbox; retrying");
        self.status
            .set_error(Source::Reading, format!("reading the outbox: {e}"));
        d.read_error = true;
        d.core.on_read_failed();
    }

    /// Counts a publish handed over: a gap notice, or its rows (the resent ones as resends).
    fn handed_over(&self, p: &Outgoing) {
        if p.rows == 0 {
            self.status.on_notice_published(p.in_flight);
        }
        for i in 0..p.rows {
            self.status.on_published(p.in_flight, i < p.resent.len());
        }
    }

    fn report(&self, report: Report) {
        let s = &self.status;
        match report {
            Report::Acked { in_flight, latency } => s.on_acked(in_flight, latency),
            Report::Answered { in_flight } => s.on_answered(in_flight),
            Report::GapAnnounced(n) => s.on_gap_announced(n),
            Report::NoticeLost(why) => s.set_error(
                Source::Reading,
                format!("a gap notice could not be published: {why}"),
            ),
            Report::Quota(why) => s.set_error(Source::Quota, why),
            Report::QuotaCleared => s.clear_error(Source::Quota),
        }
    }

    fn handle_all(&mut self, d: &mut Driver, signals: Vec<Signal>) {
        for signal in signals {
            self.handle(d, signal);
        }
    }

    fn handle(&mut self, d: &mut Driver, signal: Signal) {
        match signal {
            Signal::Connected(link) => self.on_connected(d, link),
            Signal::Event(Event::Published(pkid, written)) => {
                d.core.on_published(pkid, written);
                // On the wire, not yet acknowledged (QoS 0 status messages report id 0).
                if pkid != 0 {
                    crate::failpoint::hit("after-publish-before-puback");
                }
            }
            Signal::Event(Event::AwaitAck(pkid)) => d.core.on_await_ack(pkid),
            // The time the connection thread took, on the same clock as the write times: the
            // latency and a quota pause count from when the PUBACK was read, not from when this
            // thread got round to it.
            Signal::Event(Event::PubAck(ack, read)) => {
                if ack.verdict == crate::mqtt::event::Verdict::Accepted {
                    crate::failpoint::hit("after-puback-before-mark");
                }
                d.core.on_puback(ack, read);
            }
            // Only the command intake acts on the end of a burst of deliveries; the ends of reads
            // and idle waits only say when the connection thread sends what it gathered.
            Signal::Event(_) | Signal::Quiet | Signal::ReadEnd | Signal::Idle => {}
            Signal::Disconnected(cause) => {
                d.core.on_disconnected(&cause, Instant::now());
                d.client = None;
                if cause.kind == crate::mqtt::event::CauseKind::Renew {
                    self.status.on_renewing();
                } else {
                    self.status.on_disconnected(cause.text);
                }
                self.drive(d);
            }
        }
    }

    fn on_connected(&mut self, d: &mut Driver, link: Link) {
        d.core.on_connected(&link.granted, Instant::now());
        self.status.on_connected(&link.granted);
        self.status.set_broker(&link.endpoint);
        self.status.set_credential_expires(link.credential_expires);
        if let Some(topic) = self.config.mqtt.status() {
            // QoS 0 reports packet id 0, which the tracker ignores: it is not a row.
            let _ = link
                .client
                .try_publish(topic, QoS::AtMostOnce, true, "online", Extra::default());
        }
        #[cfg(feature = "schemas")]
        if let Some(topic) = &self.config.schema_topic {
            match crate::payload_schema::encode_published(
                self.options.limits.schemas.schemas.iter().map(|c| &c.def),
            ) {
                // QoS 0 like the status: packet id 0, which the tracker ignores.
                Ok(list) => {
                    let _ = link
                        .client
                        .try_publish(topic, QoS::AtMostOnce, true, list, Extra::default());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the payload schemas could not be encoded for publishing")
                }
            }
        }
        d.client = Some(link.client);
    }

    fn hand_over_acks(&self, acked: &mut Vec<i64>) {
        if !self.marks.send(acked) {
            // Only if the marker thread died: the rows stay unmarked and are published again.
            tracing::error!("the marker thread is gone; acknowledged rows stay in the outbox");
            acked.clear();
        }
    }

    /// Timers, checked every tick whether the relay is busy or idle: the core's (the ack timeout,
    /// the end of a quota pause), and cleanup (a device that never catches up must still prune
    /// and vacuum).
    fn on_tick(&mut self, d: &mut Driver) {
        let now = Instant::now();
        d.core.on_tick(now);
        // What the timers let go (a quiet start over, a quota pause's renewal) goes now, not
        // at the next wake-up.
        self.drive(d);
        if now >= d.next_check && d.stopping.is_none() {
            d.next_check = now + self.config.integrity_interval;
            match crate::store::quick_check(&self.conn, self.options.integrity_budget) {
                Ok(None) => {}
                Ok(Some(why)) => {
                    tracing::error!(damage = %why, "the database file is damaged: restart the application to salvage it");
                    self.status
                        .set_error(Source::Damaged, format!("the database file is damaged: {why}"));
                    self.status.set_damaged(why);
                }
                Err(e) => tracing::warn!(error = %e, "could not check the database file"),
            }
        }
        if let Err(e) = d.uptime.advance(&self.conn, false) {
            tracing::warn!(error = %e, "could not write the uptime clock forward");
        }
        if now >= d.next_prune && d.stopping.is_none() {
            let done = match crate::store::maintain_for(&self.conn, &self.options, PRUNE_SLICE) {
                Ok(m) => {
                    // Its own writes (rows expired, with their gap rows) change no data version
                    // it can see, and the file watch may be off: read again for the notices.
                    if m.deleted > 0 {
                        d.core.on_change();
                    }
                    m.done
                }
                Err(e) => {
                    tracing::warn!(error = %e, "pruning failed");
                    true
                }
            };
            d.next_prune = now
                + if done {
                    self.config.prune_interval
                } else {
                    PRUNE_PAUSE
                };
        }
    }

    /// When the next timer is due: the core's, the next cleanup, the uptime clock's next write
    /// (an idle relay has only the last two), or the end of the shutdown wait.
    fn next_timer(&self, d: &Driver) -> Instant {
        // No cleanup while stopping.
        let next = match d.stopping {
            None => d.next_prune,
            Some(deadline) => deadline,
        };
        let next = d.core.next_timeout().map_or(next, |t| next.min(t));
        next.min(d.uptime.due())
    }

    fn on_idle(&mut self, d: &mut Driver) {
        d.core.on_idle();
        match data_version(&self.conn) {
            // Another connection committed, which settles the watch's rechecks. The relay's own
            // marker is one: only a commit that brought a row or a gap row is news.
            Ok(v) if v != d.data_version => {
                d.data_version = v;
                if d.new_rows.appeared(&self.conn) {
                    d.core.on_change();
                }
                d.unsettled.settle();
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not poll the database for changes"),
        }
    }
}
