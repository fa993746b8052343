//! The publisher: keeps the in-flight window full from the outbox and hands rows to the marker
//! (see [`super::marker`]) as their PUBACKs arrive.
//!
//! The window is ack-driven: every PUBACK frees a slot that is refilled at once from a cursor on
//! `seq`. A stop-and-wait loop (select a batch, wait for all its PUBACKs, mark, repeat) measured
//! 0.09 of raw rumqttc throughput against a default mosquitto, whose Nagle delay holds the last
//! PUBACKs of each batch for about 40 ms; a full window measured 0.99.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select};
use rumqttc::{Client, Event, Outgoing, Packet, QoS};
use rusqlite::Connection;

use super::RelayConfig;
use super::marker::Marks;
use super::rows::{self, Encoding, Ready, Unpublishable};
use super::status::StatusCell;
use super::tracker::Tracker;
use crate::error::Result;
use crate::store::{Options, Synchronous};

/// What the connection thread sends the publisher.
pub(crate) enum Msg {
    Event(Event),
    /// The connection failed; reply once no more requests will be submitted for it.
    Disconnected(String, Sender<()>),
}

pub(crate) struct Publisher {
    pub conn: Connection,
    pub marks: Marks,
    pub options: Options,
    pub config: RelayConfig,
    pub client: Client,
    pub events: Receiver<Msg>,
    pub wake: Receiver<()>,
    pub stop: Receiver<()>,
    pub status: Arc<StatusCell>,
}

struct State {
    connected: bool,
    tracker: Tracker,
    /// Encoded rows read ahead of the window, in sequence order.
    ready: VecDeque<Ready>,
    /// Highest sequence number read so far on this connection.
    cursor: i64,
    /// Highest sequence number handed to rumqttc, on any connection.
    highest_submitted: i64,
    /// Rows up to this number were handed to rumqttc on an earlier connection: handing one over
    /// again is a resend.
    resend_through: i64,
    /// The last read found no more rows; read again only when something may have changed.
    at_end: bool,
    /// The last read failed; retry at the next idle tick.
    read_failed: bool,
    /// Under `synchronous = NORMAL`: every row up to this sequence number is known to be on disk
    /// (a durability barrier committed after it). Kept across reconnects.
    durable_through: i64,
    /// Acknowledged rows not yet handed to the marker.
    acked: Vec<i64>,
    data_version: i64,
    stopping: Option<Instant>,
    last_prune: Instant,
}

/// Acknowledged rows go to the marker at least this often under load.
const ACK_BATCH: usize = 512;
/// Rows read from the outbox at a time, at least.
const READ_BATCH: usize = 256;
/// Queued events are taken without a `select!` (about a fifth of the publisher's time when it ran
/// once per event), but at most this many in a row, so that stop and wake-ups are still seen.
const EVENT_BURST: usize = 64;

impl Publisher {
    pub(crate) fn run(mut self) -> Result<()> {
        let mut s = State {
            connected: false,
            tracker: Tracker::default(),
            ready: VecDeque::new(),
            cursor: 0,
            highest_submitted: 0,
            resend_through: 0,
            at_end: false,
            read_failed: false,
            durable_through: 0,
            acked: Vec::new(),
            data_version: rows::data_version(&self.conn)?,
            stopping: None,
            last_prune: Instant::now(),
        };
        let mut stop = self.stop.clone();
        let mut burst = 0;
        loop {
            crate::failpoint::hit("relay-loop");
            if s.connected && s.stopping.is_none() {
                self.fill_window(&mut s);
            }
            if !s.acked.is_empty() && (s.acked.len() >= ACK_BATCH || self.events.is_empty()) {
                self.hand_over_acks(&mut s);
            }
            if let Some(deadline) = s.stopping
                && (s.tracker.in_flight() == 0 || !s.connected || Instant::now() >= deadline)
            {
                break;
            }
            if burst < EVENT_BURST
                && let Ok(msg) = self.events.try_recv()
            {
                burst += 1;
                self.handle(&mut s, msg);
                continue;
            }
            burst = 0;
            let idle_wait = match s.stopping {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => self.config.poll_interval,
            };
            select! {
                recv(self.events) -> msg => match msg {
                    Ok(msg) => self.handle(&mut s, msg),
                    // The connection thread ended (shutdown, or it failed): nothing more will come.
                    Err(_) => break,
                },
                recv(self.wake) -> _ => s.at_end = false,
                recv(stop) -> _ => {
                    tracing::info!(in_flight = s.tracker.in_flight(), "relay stopping");
                    s.stopping = Some(Instant::now() + self.config.shutdown_timeout);
                    stop = crossbeam_channel::never();
                }
                default(idle_wait) => self.on_idle(&mut s),
            }
        }
        self.marks.sync(&mut s.acked);
        if s.connected {
            // A clean DISCONNECT: the broker discards the last will, so `offline` is not sent
            // for a planned stop (the status topic gets it published explicitly instead).
            if let Some(topic) = self.config.mqtt.status() {
                let _ = self.client.try_publish(topic, QoS::AtLeastOnce, true, "offline");
            }
            let _ = self.client.try_disconnect();
        }
        self.status.set_connected(false);
        Ok(())
    }

    fn handle(&mut self, s: &mut State, msg: Msg) {
        match msg {
            Msg::Event(Event::Incoming(Packet::ConnAck(ack))) => {
                tracing::info!(session_present = ack.session_present, "relay connected");
                // clean_session = true: rumqttc dropped everything queued for the old
                // connection, so resume from the oldest row not yet acknowledged, once every
                // acknowledged row is marked.
                self.marks.sync(&mut s.acked);
                s.tracker.reset();
                s.ready.clear();
                s.cursor = if crate::mutant::active("skip-resume") {
                    s.highest_submitted
                } else {
                    0
                };
                s.resend_through = s.highest_submitted;
                s.at_end = false;
                s.connected = true;
                self.status.on_connected();
                if let Some(topic) = self.config.mqtt.status() {
                    // QoS 0 reports packet id 0, which the tracker ignores: it is not a row.
                    let _ = self.client.try_publish(topic, QoS::AtMostOnce, true, "online");
                }
            }
            Msg::Event(Event::Outgoing(Outgoing::Publish(pkid))) => {
                s.tracker.on_publish(pkid);
                // On the wire, not yet acknowledged (QoS 0 status messages report id 0).
                if pkid != 0 {
                    crate::failpoint::hit("after-publish-before-puback");
                }
            }
            Msg::Event(Event::Outgoing(Outgoing::AwaitAck(pkid))) => s.tracker.on_await_ack(pkid),
            Msg::Event(Event::Incoming(Packet::PubAck(ack))) => {
                if let Some(seq) = s.tracker.on_puback(ack.pkid) {
                    crate::failpoint::hit("after-puback-before-mark");
                    s.acked.push(seq);
                    self.status.on_acked(s.tracker.in_flight());
                }
            }
            Msg::Event(_) => {}
            Msg::Disconnected(error, reply) => {
                if s.connected {
                    tracing::warn!(%error, in_flight = s.tracker.in_flight(), "relay disconnected");
                    self.status.on_connection_lost();
                } else {
                    tracing::debug!(%error, "relay connection attempt failed");
                }
                s.connected = false;
                s.tracker.reset();
                s.ready.clear();
                self.status.on_disconnected(error);
                self.marks.sync(&mut s.acked);
                let _ = reply.send(());
            }
        }
    }

    fn fill_window(&mut self, s: &mut State) {
        let window = self.config.max_in_flight;
        while s.tracker.in_flight() < window {
            if s.ready.is_empty() {
                if s.at_end {
                    break;
                }
                if let Err(e) = self.read_ahead(s) {
                    // Transient (busy, I/O): try again at the next idle tick, not in a tight loop.
                    tracing::warn!(error = %e, "could not read the outbox; retrying");
                    self.status.set_error(format!("reading the outbox: {e}"));
                    s.ready.clear();
                    s.at_end = true;
                    s.read_failed = true;
                }
                continue;
            }
            let Some(row) = s.ready.pop_front() else { break };
            match self
                .client
                .try_publish(row.topic, QoS::AtLeastOnce, false, row.envelope)
            {
                Ok(()) => {
                    s.tracker.submit(row.seq);
                    self.status
                        .on_published(s.tracker.in_flight(), row.seq <= s.resend_through);
                    s.highest_submitted = s.highest_submitted.max(row.seq);
                    if crate::mutant::active("mark-before-puback") {
                        s.acked.push(row.seq);
                    }
                }
                Err(e) => {
                    // The request channel is sized above the window, so this means the
                    // connection thread is gone; the row stays in the outbox for next time.
                    tracing::warn!(error = %e, "could not hand a publish to rumqttc");
                    s.ready.clear();
                    s.cursor = 0;
                    s.at_end = false;
                    break;
                }
            }
        }
    }

    fn read_ahead(&mut self, s: &mut State) -> Result<()> {
        // Each read is a transaction with its locks and a statement run: read a few windows'
        // worth at a time under load (an idle relay reads the one new row anyway).
        let limit = self.config.max_in_flight.max(READ_BATCH);
        let mut bad = Vec::new();
        let enc = Encoding {
            source: &self.config.source,
            max_packet: self.config.mqtt.packet_limit(),
        };
        let before = s.ready.len();
        let read = rows::read_after(&self.conn, &enc, s.cursor, limit, &mut s.ready, &mut bad)?;
        if crate::mutant::active("reorder") {
            s.ready.make_contiguous()[before..].reverse();
        }
        if let Some(last) = read.last_seq
            && last > s.durable_through
            && self.options.synchronous == Synchronous::Normal
        {
            // Under NORMAL a returned commit may still be lost to a power cut. Publishing it
            // before it is durable could announce an order that the power cut then erases: make
            // what was read durable first. What was read was committed before the barrier.
            let high = rows::durability_barrier(&self.conn)?;
            s.durable_through = high.max(last);
        }
        s.cursor = read.last_seq.unwrap_or(s.cursor);
        s.at_end = read.rows < limit;
        if !bad.is_empty() {
            self.dead_letter(&bad);
        }
        Ok(())
    }

    fn dead_letter(&mut self, bad: &[Unpublishable]) {
        match rows::dead_letter(&mut self.conn, bad) {
            Ok(()) => self.status.on_dead_lettered(bad.len()),
            // The rows stay in the outbox and are tried again after the next reconnect.
            Err(e) => tracing::error!(error = %e, "could not dead-letter unpublishable rows"),
        }
    }

    fn hand_over_acks(&mut self, s: &mut State) {
        if !self.marks.send(&mut s.acked) {
            // Only if the marker thread died: the rows stay unmarked and are published again.
            tracing::error!("the marker thread is gone; acknowledged rows stay in the outbox");
            s.acked.clear();
        }
    }

    fn on_idle(&mut self, s: &mut State) {
        if std::mem::take(&mut s.read_failed) {
            s.at_end = false;
        }
        match rows::data_version(&self.conn) {
            Ok(v) if v != s.data_version => {
                s.data_version = v;
                s.at_end = false;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not poll the database for changes"),
        }
        if s.last_prune.elapsed() >= self.config.prune_interval {
            s.last_prune = Instant::now();
            if let Err(e) = crate::store::maintain(&self.conn, &self.options) {
                tracing::warn!(error = %e, "pruning failed");
            }
        }
    }
}

/// Shutdown waits at most this long for in-flight PUBACKs by default.
pub(crate) const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
