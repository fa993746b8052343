//! The publisher: keeps the in-flight window full from the outbox, hands rows to the marker (see
//! [`super::marker`]) as their PUBACKs arrive, and decides what happens to a row the broker
//! refuses or keeps choking on.
//!
//! The window is ack-driven: every PUBACK frees a slot that is refilled at once from a cursor on
//! `seq` (a stop-and-wait batch loop is far slower against a broker whose Nagle delay holds the
//! last PUBACKs of each batch: see the relay benchmark).
//!
//! What the broker says about a row:
//! - PUBACK success or "no matching subscribers": acknowledged, marked.
//! - PUBACK refusal (MQTT 5: not authorized, topic name invalid, payload format invalid, ...): the
//!   row moves to the dead letters with the reason code and string; the rows behind it go on.
//! - PUBACK "quota exceeded": nothing more is published for a backoff wait, then the connection
//!   is renewed and publishing resumes from the oldest unacknowledged row.
//! - The connection dies with rows on the wire: which one the broker choked on is not known while a
//!   whole window was in flight, so the next connection narrows the window to one message until
//!   it is past every row that was in flight. A connection that dies with a single row on the
//!   wire, or when no PUBACK came for the oldest within the ack timeout, is a strike against
//!   that row (all strikes at once when the broker's reason code names the packet). After
//!   `poison_disconnects` strikes in a row the row is dead-lettered as poison, so one bad row
//!   cannot stop the outbox behind it, and a single transient drop never dead-letters anything.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, select};
use rumqttc::QoS;
use rusqlite::Connection;

use super::batch::{self, Front, Step};
use super::durability::Barrier;
use super::gaps;
use super::lanes::{LANES, Lanes};
use super::marker::Marks;
use super::pacing::Pacer;
use super::rows::{self, Encoding, Ready, Sinks, Unpublishable};
use crate::error::Result;
use crate::mqtt::backoff::Backoff;
use crate::mqtt::driver::{Link, SessionHandle, Signal};
use crate::mqtt::event::{Cause, CauseKind, Event, PubAck, Verdict};
use crate::mqtt::status::{Source, StatusCell};
use crate::mqtt::tracker::{Seq, Tracker};
use crate::mqtt::{Aliases, MqttClient, Protocol};
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
    pub durable_seq: Arc<std::sync::atomic::AtomicI64>,
    pub options: Options,
    pub config: RelayConfig,
    pub events: Receiver<Signal>,
    pub session: Arc<SessionHandle>,
    pub wake: Receiver<()>,
    /// Changes to the file by anyone (see `crate::store::watch`); `None` where it is not watched.
    pub changes: Option<Receiver<()>>,
    pub stop: Receiver<()>,
    pub status: Arc<StatusCell>,
}

/// The current connection, as far as publishing goes.
struct Live {
    client: MqttClient,
    /// When the last PUBACK of this connection arrived.
    last_ack: Option<Instant>,
    /// Most rows in flight now: 1 while probing, else `full_window`.
    window: usize,
    /// Ours, lowered to the broker's receive maximum.
    full_window: usize,
    /// Largest packet: ours, lowered to the broker's maximum packet size.
    max_packet: usize,
    limit_owner: &'static str,
    aliases: Aliases,
    /// A reconnect was requested (ack timeout, quota): do not ask twice.
    renewing: bool,
}

struct State {
    live: Option<Live>,
    tracker: Tracker,
    /// Encoded rows read ahead of the window, by lane, each in sequence order.
    ready: Lanes,
    /// Highest sequence number read so far on this connection, by lane.
    cursor: [i64; LANES],
    /// Each lane's last read reached its end (lane 0 is not read while rows wait in it).
    lane_end: [bool; LANES],
    /// The file changed: read the higher lanes before publishing more of lane 0's read-ahead, so
    /// an alarm does not wait behind it.
    check_lanes: bool,
    /// Paced replay (`RelayConfig::pace_messages`): the bucket, and when it has tokens again.
    pacer: Pacer,
    paced_until: Option<Instant>,
    /// A publish made (a row taken, a batch packed) and held back by the pace: it goes next.
    held_back: Option<Publish>,
    /// Highest `outbox_gaps.gap_id` read so far on this connection.
    gap_cursor: i64,
    /// Gap notices handed out on this connection: token to `seq` range.
    notices: HashMap<i64, (i64, i64)>,
    /// Gap notices read but held until the rows before their range are queued, by token.
    held: BTreeMap<i64, Ready>,
    /// Gap ranges whose notices were acknowledged, not yet handed to the marker.
    announced: Vec<(i64, i64)>,
    /// Rows read whose expiry had passed: removed (with their gap rows) instead of published.
    expired: Vec<i64>,
    /// Which epoch each row is numbered in (read at start: epochs change only when a store is
    /// opened).
    epochs: Epochs,
    /// Highest sequence number handed to rumqttc, on any connection.
    highest_submitted: i64,
    /// Rows handed to rumqttc on an earlier connection and not acknowledged there: handing one
    /// over again is a resend (a possible duplicate downstream). Only those: a row that waited
    /// in a lower lane behind a higher-numbered one was never sent.
    unacked_at_cut: HashSet<Seq>,
    /// The last read found no more rows; read again only when something may have changed.
    at_end: bool,
    /// Batches in flight: their first row's number (the tracker's) to every row's.
    batches: HashMap<Seq, Vec<Seq>>,
    /// A partial batch waits for more rows: its first row, and until when.
    linger: Option<(Seq, Instant)>,
    /// The last read failed; retry at the next idle tick.
    read_failed: bool,
    /// A failed read's error is in the status: clear it after the next successful read.
    read_failed_error: bool,
    /// Every row up to this sequence number is known to be on stable storage (a durability
    /// barrier committed after it). Kept across reconnects.
    durable_through: i64,
    /// Acknowledged rows not yet handed to the marker.
    acked: Vec<i64>,
    /// Rows the broker refused, to move to the dead letters.
    refused: Vec<Unpublishable>,
    /// The row with strikes against it, if any.
    suspect: Option<Suspect>,
    /// A connection died with rows on the wire: publish one at a time until a row up to this one
    /// is acknowledged, so the row the broker chokes on is the only one on the wire when it does.
    probe_until: Option<Seq>,
    /// Quota exceeded: publish nothing new until then, then renew the connection; and why.
    paused_until: Option<(Instant, String)>,
    quota_backoff: Backoff,
    /// A quota pause's error is in the status: clear it at the next accepted PUBACK.
    quota_error: bool,
    /// Topic aliases misbehaved on this broker: never use them again in this run.
    aliases_off: bool,
    data_version: i64,
    /// The file changed and the commit may not be visible yet: check `data_version` soon.
    unsettled: Unsettled,
    stopping: Option<Instant>,
    next_prune: Instant,
    next_check: Instant,
    /// The time this relay runs, written forward into the file (retention's second clock).
    uptime: UptimeClock,
}

/// One MQTT publish, ready to hand over: a row, or a batch of rows (`members`, packed into `row`).
struct Publish {
    row: Ready,
    members: Option<Vec<Ready>>,
    /// The lane it was taken from.
    lane: usize,
}

impl Publish {
    /// Whether a row of it has expired by `now` (Unix ms).
    fn has_expired(&self, now: i64) -> bool {
        let expired = |r: &Ready| r.expires_at.is_some_and(|t| t <= now);
        match &self.members {
            Some(rows) => rows.iter().any(expired),
            None => expired(&self.row),
        }
    }

    /// Unpacks it: the rows it was taken as, in order.
    fn into_rows(self) -> Vec<Ready> {
        self.members.unwrap_or_else(|| vec![self.row])
    }
}

/// A row that was the oldest unacknowledged one when connections died.
struct Suspect {
    seq: Seq,
    strikes: u32,
}

/// A connection that ends this soon after the only message on the wire was written counts against
/// that message (a broker rejecting a packet closes at once; a flaky link drops at any time).
const CHOKE_WINDOW: Duration = Duration::from_secs(2);

/// Acknowledged rows go to the marker at least this often under load.
const ACK_BATCH: usize = 512;
/// Rows read from the outbox at a time, at least.
const READ_BATCH: usize = 256;
/// Gap rows read at a time: more than rows, because consecutive ones merge into one notice (a
/// long outage of coalescing sensors leaves long runs).
const GAP_READ_BATCH: usize = 4096;
/// Queued events are taken without a `select!`, but at most this many in a row, so that stop and
/// wake-ups are still seen.
const EVENT_BURST: usize = 64;
/// With the file watched, an idle relay still checks it this often (or at its poll interval, if
/// longer): the safety net for a change the watch missed.
const SAFETY_POLL: Duration = Duration::from_secs(2);
/// One slice of cleanup takes at most this long; the next slice follows after `PRUNE_PAUSE`.
const PRUNE_SLICE: Duration = Duration::from_millis(25);
const PRUNE_PAUSE: Duration = Duration::from_millis(250);
/// Bytes of MQTT 5 publish properties at most: their length, and a topic alias.
const V5_PROPERTIES: usize = 4;

impl Publisher {
    pub(crate) fn run(mut self) -> Result<()> {
        let now = Instant::now();
        let mut s = State {
            live: None,
            tracker: Tracker::default(),
            ready: Lanes::default(),
            cursor: [0; LANES],
            lane_end: [false; LANES],
            check_lanes: false,
            pacer: Pacer::new(self.config.pace),
            paced_until: None,
            held_back: None,
            gap_cursor: 0,
            notices: HashMap::new(),
            held: BTreeMap::new(),
            announced: Vec::new(),
            expired: Vec::new(),
            epochs: Epochs::read(&self.conn)?,
            highest_submitted: 0,
            unacked_at_cut: HashSet::new(),
            at_end: false,
            batches: HashMap::new(),
            linger: None,
            read_failed: false,
            read_failed_error: false,
            durable_through: 0,
            acked: Vec::new(),
            refused: Vec::new(),
            suspect: None,
            probe_until: None,
            paused_until: None,
            quota_backoff: Backoff::new(self.config.backoff_min, self.config.backoff_max),
            quota_error: false,
            aliases_off: false,
            data_version: data_version(&self.conn)?,
            unsettled: Unsettled::default(),
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
            if s.live.is_some() && s.stopping.is_none() && s.paused_until.is_none() {
                self.fill_window(&mut s);
            }
            if !s.acked.is_empty() && (s.acked.len() >= ACK_BATCH || self.events.is_empty()) {
                self.hand_over_acks(&mut s);
            }
            if !s.refused.is_empty() {
                self.dead_letter_refused(&mut s);
            }
            if let Some(deadline) = s.stopping
                && (s.tracker.in_flight() == 0 || s.live.is_none() || Instant::now() >= deadline)
            {
                break;
            }
            if Instant::now() >= self.next_timer(&s) {
                self.on_tick(&mut s);
            }
            if burst < EVENT_BURST
                && let Ok(signal) = self.events.try_recv()
            {
                burst += 1;
                self.handle(&mut s, signal);
                continue;
            }
            burst = 0;
            // The connection thread checks for reconnect requests often only while one may come.
            self.session
                .set_watching(s.tracker.in_flight() > 0 || s.paused_until.is_some());
            let idle_wait = match s.stopping {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => s.unsettled.wait(poll),
            }
            .min(self.next_timer(&s).saturating_duration_since(Instant::now()));
            select! {
                recv(self.events) -> signal => match signal {
                    Ok(signal) => self.handle(&mut s, signal),
                    // The connection thread ended (shutdown, or it failed): nothing more will come.
                    Err(_) => break,
                },
                recv(self.wake) -> _ => {
                    s.at_end = false;
                    s.check_lanes = true;
                }
                recv(changes) -> change => match change {
                    Ok(()) => {
                        s.at_end = false;
                        s.check_lanes = true;
                        s.unsettled.on_change();
                    }
                    // The watch ended: poll as if there had never been one.
                    Err(_) => {
                        changes = crossbeam_channel::never();
                        poll = self.config.poll_interval;
                        s.at_end = false;
                    }
                },
                recv(stop) -> _ => {
                    tracing::info!(in_flight = s.tracker.in_flight(), "relay stopping");
                    s.stopping = Some(Instant::now() + self.config.shutdown_timeout);
                    stop = crossbeam_channel::never();
                }
                default(idle_wait) => self.on_idle(&mut s),
            }
        }
        self.marks.sync(&mut s.acked);
        if let Err(e) = s.uptime.advance(&self.conn, true) {
            tracing::warn!(error = %e, "could not write the uptime clock forward");
        }
        if let Some(live) = &s.live {
            // A clean DISCONNECT: the broker discards the last will, so `offline` is not sent
            // for a planned stop (the status topic gets it published explicitly instead).
            if let Some(topic) = self.config.mqtt.status() {
                let _ = live
                    .client
                    .try_publish(topic, QoS::AtLeastOnce, true, "offline", None, None);
            }
            let _ = live.client.try_disconnect();
        }
        self.status.set_connected(false);
        Ok(())
    }

    fn handle(&mut self, s: &mut State, signal: Signal) {
        match signal {
            Signal::Connected(link) => self.on_connected(s, link),
            Signal::Event(Event::Published(pkid)) => {
                s.tracker.on_publish(pkid);
                // On the wire, not yet acknowledged (QoS 0 status messages report id 0).
                if pkid != 0 {
                    crate::failpoint::hit("after-publish-before-puback");
                }
            }
            Signal::Event(Event::AwaitAck(pkid)) => s.tracker.on_await_ack(pkid),
            Signal::Event(Event::PubAck(ack)) => self.on_puback(s, ack),
            Signal::Event(_) => {}
            Signal::Disconnected(cause) => self.on_disconnected(s, cause),
        }
    }

    fn on_connected(&mut self, s: &mut State, link: Link) {
        // A clean session: nothing queued for the old connection survives, so resume from the
        // oldest row not yet acknowledged, once every acknowledged row is marked.
        self.marks.sync(&mut s.acked);
        forget_in_flight(s);
        s.ready.clear();
        s.cursor = if crate::mutant::active("skip-resume") {
            [s.highest_submitted; LANES]
        } else {
            [0; LANES]
        };
        s.lane_end = [false; LANES];
        s.held_back = None;
        s.gap_cursor = 0;
        s.notices.clear();
        s.held.clear();
        s.at_end = false;
        let g = &link.granted;
        let window = g.receive_max.map_or(self.config.max_in_flight, |m| {
            self.config.max_in_flight.min(usize::from(m).max(1))
        });
        let ours = self.config.mqtt.packet_limit();
        let (max_packet, limit_owner) = match g.max_packet_size {
            Some(theirs) if (theirs as usize) < ours => (theirs as usize, "the broker's maximum packet size"),
            _ => (ours, "MqttConfig::max_packet_size"),
        };
        let aliases = match (self.config.mqtt.version(), g.topic_alias_max) {
            (Protocol::V5, Some(max))
                if max > 0 && self.config.mqtt.uses_topic_aliases() && !s.aliases_off =>
            {
                Aliases::up_to(max)
            }
            _ => Aliases::none(),
        };
        let full_window = window;
        let window = if s.probe_until.is_some() {
            tracing::info!(
                "publishing one message at a time until past those in flight when the last connection ended"
            );
            1
        } else {
            full_window
        };
        if full_window < self.config.max_in_flight || max_packet < ours {
            tracing::info!(
                window = full_window,
                max_packet,
                "the broker's limits apply (receive maximum, maximum packet size)"
            );
        }
        self.status.on_connected(g);
        self.status.set_broker(&link.endpoint);
        if let Some(topic) = self.config.mqtt.status() {
            // QoS 0 reports packet id 0, which the tracker ignores: it is not a row.
            let _ = link
                .client
                .try_publish(topic, QoS::AtMostOnce, true, "online", None, None);
        }
        s.live = Some(Live {
            client: link.client,
            last_ack: None,
            window,
            full_window,
            max_packet,
            limit_owner,
            aliases,
            renewing: false,
        });
    }

    fn on_puback(&mut self, s: &mut State, ack: PubAck) {
        // rumqttc skips its collision check on a refusal, so a row parked on this packet id
        // would wait until the collision times out: renew the connection instead.
        let awaited = s.tracker.is_awaited(ack.pkid);
        if let Some(live) = &mut s.live {
            live.last_ack = Some(Instant::now());
        }
        let Some((seq, written)) = s.tracker.on_puback_at(ack.pkid) else {
            return;
        };
        // A batch is answered as a whole: every row in it shares the verdict.
        let members = batch::members(&mut s.batches, seq);
        let newest = members.last().copied().unwrap_or(seq);
        if s.suspect.as_ref().is_some_and(|x| x.seq == seq) {
            s.suspect = None;
        }
        if s.probe_until.is_some_and(|until| newest >= until) {
            s.probe_until = None;
            if let Some(live) = &mut s.live {
                live.window = live.full_window;
            }
        }
        match ack.verdict {
            Verdict::Accepted if gaps::is_notice(seq) => {
                self.status.on_answered(s.tracker.in_flight());
                s.quota_backoff.reset();
                self.announced(s, seq, None);
            }
            Verdict::Accepted => {
                crate::failpoint::hit("after-puback-before-mark");
                for &row in &members {
                    s.acked.push(row);
                    self.status
                        .on_acked(s.tracker.in_flight(), written.map(|t| t.elapsed()));
                }
                s.quota_backoff.reset();
                if std::mem::take(&mut s.quota_error) {
                    self.status.clear_error(Source::Quota);
                }
            }
            Verdict::Refused(reason) if gaps::is_notice(seq) => {
                self.status.on_answered(s.tracker.in_flight());
                self.announced(
                    s,
                    seq,
                    Some(format!("the broker refused it: PUBACK reason {reason}")),
                );
                if awaited {
                    self.renew(
                        s,
                        Cause::new(CauseKind::Retry, "a refused message held a packet id"),
                    );
                }
            }
            Verdict::Refused(reason) => {
                tracing::warn!(seq, rows = members.len(), %reason, "the broker refused a message: moving it to the dead letters");
                s.refused.extend(members.iter().map(|&seq| Unpublishable {
                    seq,
                    reason: format!("the broker refused it: PUBACK reason {reason}"),
                }));
                self.status.on_answered(s.tracker.in_flight());
                if awaited {
                    self.renew(
                        s,
                        Cause::new(CauseKind::Retry, "a refused message held a packet id"),
                    );
                }
            }
            Verdict::Later(reason) => {
                self.status.on_answered(s.tracker.in_flight());
                let wait = s.quota_backoff.next_delay();
                tracing::warn!(seq, %reason, ?wait, "the broker cannot take more now: publishing again after a wait");
                let why = format!("the broker refused a message for now: PUBACK reason {reason}");
                self.status.set_error(Source::Quota, why.clone());
                s.quota_error = true;
                s.paused_until = Some((Instant::now() + wait, why));
                if awaited {
                    self.renew(
                        s,
                        Cause::new(CauseKind::Retry, "a refused message held a packet id"),
                    );
                }
            }
        }
    }

    /// A gap notice is done with: acknowledged, or (with `failed`) given up on, which loses the
    /// announcement (the cloud then sees those numbers as an unexplained gap) and is logged.
    fn announced(&mut self, s: &mut State, token: i64, failed: Option<String>) {
        let Some(range) = s.notices.remove(&token) else {
            return;
        };
        match failed {
            None => self.status.on_gap_announced(range.1 - range.0 + 1),
            Some(why) => {
                tracing::error!(first = range.0, last = range.1, %why, "a gap notice could not be published: the cloud will see these messages as an unexplained gap");
                self.status.set_error(
                    Source::Reading,
                    format!("a gap notice could not be published: {why}"),
                );
            }
        }
        s.announced.push(range);
        if !self.marks.send_announced(&mut s.announced) {
            tracing::error!("the marker thread is gone; announced gaps stay recorded");
            s.announced.clear();
        }
    }

    fn on_disconnected(&mut self, s: &mut State, cause: Cause) {
        if cause.text.contains("0x94") || cause.text.contains("0x82") {
            if !s.aliases_off {
                tracing::warn!(%cause, "not using topic aliases with this broker any more");
            }
            s.aliases_off = true;
        }
        self.strike(s, &cause);
        s.live = None;
        forget_in_flight(s);
        s.ready.clear();
        // Retried on the next connection, whatever the wait was for.
        s.paused_until = None;
        self.status.on_disconnected(cause.text);
        self.marks.sync(&mut s.acked);
    }

    /// Counts the connection's end against its oldest unacknowledged row on the wire when that
    /// row is to blame, narrows the window for the next connection, and sets a row aside once it
    /// has had enough.
    fn strike(&mut self, s: &mut State, cause: &Cause) {
        let threshold = self.config.poison_disconnects;
        let Some((seq, _)) = s.tracker.oldest_on_wire() else {
            return;
        };
        if matches!(
            cause.kind,
            CauseKind::Connect | CauseKind::Broker | CauseKind::Retry
        ) {
            // Not the messages' doing: no strike, and no need to narrow the window.
            return;
        }
        if threshold == 0 {
            return;
        }
        let (_, written) = s.tracker.oldest_on_wire().unwrap_or((seq, Instant::now()));
        let acked_since = s
            .live
            .as_ref()
            .and_then(|l| l.last_ack)
            .is_some_and(|at| at > written);
        let strikes = match cause.kind {
            CauseKind::NamesPacket => threshold,
            // The broker acknowledged later messages and not this one: this one's doing. Once
            // that is established, later timeouts count too, even with nothing left to compare
            // with (the rest has drained).
            CauseKind::Requested if acked_since || s.suspect.as_ref().is_some_and(|x| x.seq == seq) => 1,
            // No PUBACK at all since it was written, and no earlier evidence: a broker (or link)
            // that acknowledges nothing says nothing about this message. Renewing is all.
            CauseKind::Requested => {
                tracing::debug!(seq, %cause, "no acknowledgement at all since it was written: no strike");
                return;
            }
            // The connection ended with only this message on the wire, and soon after it was
            // written, as a broker that rejects a packet by closing does. A link that drops at
            // some other moment is no evidence against it.
            CauseKind::Lost if s.tracker.on_wire() == 1 && written.elapsed() < CHOKE_WINDOW => 1,
            CauseKind::Lost if s.tracker.on_wire() == 1 => return,
            // A whole window was on the wire: no telling which one. The next connection
            // publishes one at a time, which will.
            _ => {
                s.probe_until = newest_in_flight(s).max(s.probe_until);
                tracing::debug!(on_wire = s.tracker.on_wire(), %cause, "connection lost with a window in flight: narrowing it");
                return;
            }
        };
        if let Some(rows) = s.batches.get(&seq) {
            // Evidence against a batch is none against any one row in it: publish its rows one
            // at a time on the next connection, where a bad one is found alone.
            s.probe_until = rows.last().copied().max(s.probe_until);
            tracing::debug!(%cause, strikes, "the connection ended over a batch: publishing its rows one at a time");
            return;
        }
        let suspect = match &mut s.suspect {
            Some(x) if x.seq == seq => {
                x.strikes += strikes;
                x
            }
            other => other.insert(Suspect { seq, strikes }),
        };
        if suspect.strikes < threshold {
            tracing::info!(seq, strikes = suspect.strikes, threshold, %cause, "the oldest unacknowledged message was on the wire when the connection ended");
            return;
        }
        let reason = if cause.kind == CauseKind::NamesPacket {
            format!("poison: the broker closed the connection over it: {cause}")
        } else {
            format!(
                "poison: it was the oldest unacknowledged message when {} connections in a row ended; last: {cause}",
                suspect.strikes
            )
        };
        s.suspect = None;
        if gaps::is_notice(seq) {
            self.announced(s, seq, Some(reason));
            return;
        }
        tracing::warn!(seq, %reason, "isolating a message the broker keeps choking on");
        match rows::dead_letter(&mut self.conn, &[Unpublishable { seq, reason }]) {
            Ok(()) => {
                self.status.on_dead_lettered(1);
                self.status.on_isolated();
            }
            // It stays in the outbox and is published again; the strikes start over.
            Err(e) => tracing::error!(error = %e, seq, "could not dead-letter a poison message"),
        }
    }

    /// Asks the connection thread for a new connection (at most once per connection).
    fn renew(&self, s: &mut State, cause: Cause) {
        if let Some(live) = &mut s.live
            && !live.renewing
        {
            live.renewing = true;
            self.session.request_reconnect(cause);
        }
    }

    fn fill_window(&mut self, s: &mut State) {
        if let Some(until) = s.paced_until {
            if Instant::now() < until {
                return;
            }
            s.paced_until = None;
        }
        loop {
            let Some(live) = &s.live else { return };
            if s.tracker.in_flight() >= live.window {
                return;
            }
            if !s.at_end && (s.ready.is_empty() || std::mem::take(&mut s.check_lanes)) {
                self.read_more(s, None);
                continue;
            }
            // Rows that expired while they waited here (a pace, a full window) are never
            // published late: the next read removes them and records their gaps.
            // Only the head is checked for a row that goes alone: no scan per publish.
            let whole = !self.config.batching.is_empty();
            if s.ready.drop_expired(crate::time::now_ms(), whole, &mut s.expired) {
                s.at_end = false;
                s.check_lanes = true;
                continue;
            }
            let publish = match s.held_back.take() {
                // Packed before, held back by the pace, and a row of it expired while it waited:
                // its rows go back to the head of their lane, where the check above removes the
                // expired ones (and records their gaps) before the rest is taken again.
                Some(held)
                    if held.has_expired(crate::time::now_ms())
                        && !crate::mutant::active("skip-expiry-held-back") =>
                {
                    let lane = s.ready.lane(held.lane);
                    for row in held.into_rows().into_iter().rev() {
                        lane.push_front(row);
                    }
                    continue;
                }
                // Packed before, held back by the pace.
                Some(held) => held,
                None => {
                    let Some((lane, queue)) = s.ready.front_lane() else {
                        return;
                    };
                    let step = if self.config.batching.is_empty() {
                        Step::Single
                    } else {
                        let front = Front {
                            rules: &self.config.batching,
                            max_packet: live.max_packet,
                            properties: self.properties(),
                            at_end: s.lane_end[lane],
                            probing: s.probe_until.is_some(),
                            now: Instant::now(),
                        };
                        batch::next(queue, &front, &mut s.linger)
                    };
                    let (row, members) = match step {
                        Step::ReadMore if s.lane_end[lane] => return,
                        Step::ReadMore => {
                            self.read_more(s, Some(lane));
                            continue;
                        }
                        Step::Linger(_) => return,
                        Step::Single => match queue.pop_front() {
                            Some(row) => (row, None),
                            None => return,
                        },
                        Step::Batch(n, rule) => {
                            let (row, members) = batch::take(queue, n, &rule);
                            (row, Some(members))
                        }
                    };
                    s.linger = None;
                    Publish { row, members, lane }
                }
            };
            if let Err(until) = s.pacer.take(
                publish.row.topic.len() + publish.row.envelope.len(),
                Instant::now(),
            ) {
                s.held_back = Some(publish);
                s.paced_until = Some(until);
                return;
            }
            let Publish { row, members, .. } = publish;
            let Some(live) = &mut s.live else { return };
            let alias = live.aliases.for_topic(&row.topic);
            let expiry = row
                .expires_at
                .filter(|_| self.config.mqtt.sends_message_expiry())
                .map(seconds_left);
            match live
                .client
                .try_publish(&row.topic, QoS::AtLeastOnce, false, row.envelope, alias, expiry)
            {
                Ok(()) => {
                    s.tracker.submit(row.seq);
                    if gaps::is_notice(row.seq) {
                        self.status.on_notice_published(s.tracker.in_flight());
                        continue;
                    }
                    let rows = members.map_or_else(|| vec![row.seq], |m| m.iter().map(|r| r.seq).collect());
                    for &seq in &rows {
                        let resend = s.unacked_at_cut.remove(&seq);
                        self.status.on_published(s.tracker.in_flight(), resend);
                        s.highest_submitted = s.highest_submitted.max(seq);
                        if crate::mutant::active("mark-before-puback") {
                            s.acked.push(seq);
                        }
                    }
                    if rows.len() > 1 {
                        s.batches.insert(row.seq, rows);
                    }
                }
                Err(_) => {
                    // The request channel is sized above the window, so this means the
                    // connection is gone; the row stays in the outbox for the next one.
                    tracing::debug!("could not hand a publish to rumqttc: the connection is ending");
                    s.ready.clear();
                    s.live = None;
                    return;
                }
            }
        }
    }

    /// Reads ahead (the higher lanes, and lane 0 when its queue is used up or `extend` asks for
    /// it: a batch that runs to the end of what was read).
    fn read_more(&mut self, s: &mut State, extend: Option<usize>) {
        if let Err(e) = self.read_ahead(s, extend) {
            // Transient (busy, I/O): try again at the next idle tick, not in a tight loop.
            tracing::warn!(error = %e, "could not read the outbox; retrying");
            self.status
                .set_error(Source::Reading, format!("reading the outbox: {e}"));
            // What was read ahead before stays: the cursors did not move past it.
            s.at_end = true;
            s.read_failed = true;
            s.read_failed_error = true;
        }
    }

    /// Bytes of MQTT properties a publish may carry on this connection.
    fn properties(&self) -> usize {
        match self.config.mqtt.version() {
            Protocol::V5 => V5_PROPERTIES,
            Protocol::V311 => 0,
        }
    }

    fn read_ahead(&mut self, s: &mut State, extend: Option<usize>) -> Result<()> {
        let Some(live) = &s.live else { return Ok(()) };
        // Each read is a transaction with its locks and a statement run: read a few windows'
        // worth at a time under load (an idle relay reads the one new row anyway).
        let limit = self.config.max_in_flight.max(READ_BATCH);
        let mut bad = Vec::new();
        let enc = Encoding {
            source: &self.config.source,
            epochs: &s.epochs,
            max_packet: live.max_packet,
            limit_owner: live.limit_owner,
            properties: self.properties(),
            allow_dollar: self.options.limits.dollar_topics_allowed(),
            ttl: &self.config.ttl,
        };
        let mut notices = VecDeque::new();
        let gap_read = gaps::read_after(
            &self.conn,
            &enc,
            s.gap_cursor,
            GAP_READ_BATCH,
            &mut notices,
            &mut s.notices,
        )?;
        s.gap_cursor = gap_read.last_gap_id.unwrap_or(s.gap_cursor);
        s.held.extend(notices.into_iter().map(|n| (n.seq, n)));
        // The higher lanes at every read (an index probe each when empty), lane 0 only when its
        // read-ahead is used up or a batch needs what follows it.
        let mut fresh: [VecDeque<Ready>; LANES] = Default::default();
        let mut claim = Vec::new();
        let mut last_read: Option<i64> = None;
        let lane0 = s.ready.lane(0).is_empty() || extend == Some(0);
        // Cursors move only once every read (and the claim) succeeded: a failed read drops what
        // it got, to be read again.
        let mut cursor = s.cursor;
        let mut lane_end = s.lane_end;
        for lane in (0..LANES).rev() {
            if lane == 0 && !lane0 {
                // Rows are still queued in lane 0, so it is not at its end.
                lane_end[0] = false;
                continue;
            }
            let sinks = Sinks {
                ready: &mut fresh[lane],
                bad: &mut bad,
                expired: &mut s.expired,
                claim: &mut claim,
            };
            let read = rows::read_after(&self.conn, &enc, lane as u8, cursor[lane], limit, sinks)?;
            lane_end[lane] = read.rows < limit;
            cursor[lane] = read.last_seq.unwrap_or(cursor[lane]);
            last_read = last_read.max(read.last_seq);
        }
        if std::mem::take(&mut s.read_failed_error) {
            self.status.clear_error(Source::Reading);
        }
        if !claim.is_empty() && !crate::mutant::active("skip-claim") {
            // Coalescing rows a newer value replaced since the read are gone (their gap rows
            // are recorded): publishing them would send a replaced value.
            let gone = rows::claim(&mut self.conn, &claim)?;
            if !gone.is_empty() {
                fresh
                    .iter_mut()
                    .for_each(|q| q.retain(|r| !gone.contains(&r.seq)));
            }
        }
        s.cursor = cursor;
        s.lane_end = lane_end;
        let [lane0_rows, higher @ ..] = &mut fresh;
        for (i, q) in higher.iter_mut().enumerate() {
            s.ready.lane(i + 1).append(q);
        }
        if crate::mutant::active("reorder") {
            lane0_rows.make_contiguous().reverse();
        }
        // Notices go out in number order among lane 0's rows, so the cloud sees one ordered
        // stream: before the first row above their range, and once the rows are read past them
        // (all of them at the end of the outbox). A removal behind the cursor goes out at once.
        for row in lane0_rows.drain(..) {
            release_notices(&mut s.held, s.ready.lane(0), row.seq);
            s.ready.lane(0).push_back(row);
        }
        release_notices(
            &mut s.held,
            s.ready.lane(0),
            if s.lane_end[0] {
                i64::MAX
            } else {
                s.cursor[0].saturating_add(1)
            },
        );
        if let Some(last) = last_read
            && last > s.durable_through
        {
            // A FULL commit through the application's handle synced the WAL after these rows.
            s.durable_through = s
                .durable_through
                .max(self.durable_seq.load(std::sync::atomic::Ordering::Acquire));
        }
        if let Some(last) = last_read
            && last > s.durable_through
        {
            // Whoever wrote these rows, and with whatever `synchronous` setting, their commit
            // may not be on stable storage yet (a NORMAL writer's is not until the WAL is
            // synced). Publishing it first could announce a change that a power cut then erases:
            // sync the WAL once for everything read. What was read was committed before it.
            // (See super::durability.)
            let high = self.barrier.sync(&self.conn)?;
            self.status.on_wal_sync();
            s.durable_through = high.max(last);
        }
        s.at_end = s.lane_end.iter().all(|&end| end) && gap_read.rows < GAP_READ_BATCH;
        if !bad.is_empty() {
            self.dead_letter(&bad);
            // Their gap rows are new: read them.
            s.at_end = false;
        }
        if !s.expired.is_empty() {
            match rows::expire(&mut self.conn, &mut s.expired) {
                Ok(n) => self.status.on_expired(n),
                // They stay, and are found expired again on the next read.
                Err(e) => {
                    tracing::error!(error = %e, "could not remove expired rows");
                    s.expired.clear();
                }
            }
            s.at_end = false;
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

    fn dead_letter_refused(&mut self, s: &mut State) {
        let refused = std::mem::take(&mut s.refused);
        match rows::dead_letter(&mut self.conn, &refused) {
            Ok(()) => {
                s.at_end = false;
                self.status.on_dead_lettered(refused.len());
                self.status.on_refused(refused.len());
            }
            // They stay in the outbox and are published again after the next reconnect.
            Err(e) => tracing::error!(error = %e, "could not dead-letter refused rows"),
        }
    }

    fn hand_over_acks(&mut self, s: &mut State) {
        if !self.marks.send(&mut s.acked) {
            // Only if the marker thread died: the rows stay unmarked and are published again.
            tracing::error!("the marker thread is gone; acknowledged rows stay in the outbox");
            s.acked.clear();
        }
    }

    /// Timers, checked every tick whether the relay is busy or idle: the ack timeout, the end of
    /// a quota pause, and cleanup (a device that never catches up must still prune and vacuum).
    fn on_tick(&mut self, s: &mut State) {
        let now = Instant::now();
        if let Some((seq, written)) = s.tracker.oldest_on_wire()
            && s.live.as_ref().is_some_and(|l| !l.renewing)
            && now.duration_since(written) >= self.config.ack_timeout
        {
            let cause = Cause::new(
                CauseKind::Requested,
                format!(
                    "no PUBACK within {:?} for the oldest message in flight (seq {seq})",
                    self.config.ack_timeout
                ),
            );
            self.renew(s, cause);
        }
        if s.paused_until.as_ref().is_some_and(|(t, _)| now >= *t)
            && let Some((_, why)) = s.paused_until.take()
        {
            self.renew(
                s,
                Cause::new(CauseKind::Retry, format!("{why}; publishing it again")),
            );
        }
        if now >= s.next_check && s.stopping.is_none() {
            s.next_check = now + self.config.integrity_interval;
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
        if let Err(e) = s.uptime.advance(&self.conn, false) {
            tracing::warn!(error = %e, "could not write the uptime clock forward");
        }
        if now >= s.next_prune && s.stopping.is_none() {
            let done = match crate::store::maintain_for(&self.conn, &self.options, PRUNE_SLICE) {
                Ok(m) => m.done,
                Err(e) => {
                    tracing::warn!(error = %e, "pruning failed");
                    true
                }
            };
            s.next_prune = now
                + if done {
                    self.config.prune_interval
                } else {
                    PRUNE_PAUSE
                };
        }
    }

    /// When the next timer is due: the oldest message's ack timeout (while a renewal can still be
    /// asked for), the end of a quota pause, the next cleanup, the uptime clock's next write. An
    /// idle relay has only the last two.
    fn next_timer(&self, s: &State) -> Instant {
        // No cleanup while stopping.
        let mut next = match s.stopping {
            None => s.next_prune,
            Some(deadline) => deadline,
        };
        if let Some((_, written)) = s.tracker.oldest_on_wire()
            && s.live.as_ref().is_some_and(|l| !l.renewing)
        {
            next = next.min(written + self.config.ack_timeout);
        }
        if let Some((until, _)) = &s.paused_until {
            next = next.min(*until);
        }
        if let Some(until) = s.paced_until {
            next = next.min(until);
        }
        // A lingering batch, while its first row is still next and it could be published (a
        // stale deadline would wake the loop at once, again and again).
        if let Some((seq, until)) = s.linger
            && s.ready.front().is_some_and(|r| r.seq == seq)
            && s.stopping.is_none()
            && s.paused_until.is_none()
            && s.live.as_ref().is_some_and(|l| s.tracker.in_flight() < l.window)
        {
            next = next.min(until);
        }
        next.min(s.uptime.due())
    }

    fn on_idle(&mut self, s: &mut State) {
        if std::mem::take(&mut s.read_failed) {
            s.at_end = false;
        }
        match data_version(&self.conn) {
            Ok(v) if v != s.data_version => {
                s.data_version = v;
                s.at_end = false;
                s.check_lanes = true;
                s.unsettled.settle();
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not poll the database for changes"),
        }
    }
}

/// What is left of a lifetime ending at `expires_at` (Unix ms), in whole seconds rounded up, at
/// least 1: MQTT 5's message expiry interval (0 would be sent as "no expiry" by nobody, but
/// expire at once on some brokers).
fn seconds_left(expires_at: i64) -> u32 {
    let ms = expires_at.saturating_sub(crate::time::now_ms()).max(1);
    u32::try_from((ms + 999) / 1000).unwrap_or(u32::MAX)
}

/// The newest row handed to rumqttc and not yet acknowledged, the rows of batches included.
/// The connection is gone: nothing in flight on it will be acknowledged. What was in flight is
/// remembered, so that handing it over again counts as a resend.
fn forget_in_flight(s: &mut State) {
    let in_flight: Vec<Seq> = s.tracker.unacknowledged().collect();
    for seq in in_flight {
        match s.batches.get(&seq) {
            Some(members) => s.unacked_at_cut.extend(members),
            None if gaps::is_notice(seq) => {}
            None => {
                s.unacked_at_cut.insert(seq);
            }
        }
    }
    s.tracker.reset();
    s.batches.clear();
}

fn newest_in_flight(s: &State) -> Option<Seq> {
    let batched = s.batches.values().filter_map(|rows| rows.last().copied()).max();
    s.tracker.newest_in_flight().max(batched)
}

/// Moves the held gap notices whose range starts below outbox row `below` to the end of `ready`.
fn release_notices(held: &mut BTreeMap<i64, Ready>, ready: &mut VecDeque<Ready>, below: i64) {
    let limit = gaps::TOKEN_BASE.saturating_add(below);
    while let Some(entry) = held.first_entry() {
        if *entry.key() >= limit {
            return;
        }
        ready.push_back(entry.remove());
    }
}
