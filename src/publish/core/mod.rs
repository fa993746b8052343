//! The publishing core: every decision of the publishing side, as a value with no threads,
//! sockets, clocks or SQLite inside (the sans-IO style of quinn-proto and str0m).
//!
//! What it decides: what to read next in each lane, what to claim, how to pack a batch, when the
//! pace allows the next publish, what expired while it waited, which row a PUBACK acknowledges
//! and what its reason code means, how to resume after a cut, which row to isolate as poison,
//! and when a gap notice goes out among the rows.
//!
//! Its inputs are the driver's calls: a connection up ([`Core::on_connected`]) or down
//! ([`Core::on_disconnected`]), rumqttc's packet events, PUBACKs with their reason codes, the
//! results of reads and claims, a change to the file, and the time, which every call that needs
//! it takes as an argument. Its outputs are [`Action`]s, taken with [`Core::poll`] until it
//! returns `None`, and the time it wants to be woken at ([`Core::next_timeout`]).
//!
//! The driver (`super::publisher`) owns the SQLite connection, the MQTT client, the marker's
//! channel and the status, and performs each action; the model test
//! (`tests` in this module) drives the same core against a simulated broker instead.

mod action;
mod intake;
#[cfg(test)]
mod model;
mod probe;
mod ranges;
mod verdicts;
mod window;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Instant;

pub(crate) use action::{Action, LaneRead, Outgoing, ReadRequest, ReadResult, Removal, Report};

use super::lanes::{LANES, Lanes};
use super::pacing::Pacer;
use super::rows::Ready;
use crate::mqtt::backoff::Backoff;
use crate::mqtt::event::Granted;
use crate::mqtt::tracker::{Seq, Tracker, Wrote};
use crate::mqtt::{Aliases, Protocol};
use crate::relay_config::RelayConfig;

/// Acknowledged rows go to the marker at least this often under load.
const ACK_BATCH: usize = 512;
/// Rows read from the outbox at a time, at least.
const READ_BATCH: usize = 256;
/// Gap rows read at a time: more than rows, because consecutive ones merge into one notice (a
/// long outage of coalescing sensors leaves long runs).
const GAP_READ_BATCH: usize = 4096;
/// Bytes of MQTT 5 publish properties at most: their length, and a topic alias.
const V5_PROPERTIES: usize = 4;

/// The current connection, as far as publishing goes.
struct Live {
    /// The newest write (`Wrote::nth`) among the rows this connection's PUBACKs answered: a row
    /// written before it and still unanswered is one the broker passed over.
    newest_answered: Option<Wrote>,
    /// Most rows in flight now: 1 while probing, else `full_window`.
    window: usize,
    /// Ours, lowered to the broker's receive maximum.
    full_window: usize,
    /// Hand-overs beyond the window when the broker's receive maximum lowered it (up to ours,
    /// `max_in_flight`, in all): they wait in rumqttc's queue, which writes the next one as soon
    /// as a PUBACK frees a slot, instead of after the PUBACK has reached this thread and a new
    /// hand-over has gone back. Never a publish with a lifetime (see `Publish::has_lifetime`).
    queue: usize,
    /// Largest packet: ours, lowered to the broker's maximum packet size.
    max_packet: usize,
    limit_owner: &'static str,
    aliases: Aliases,
    /// A reconnect was requested (ack timeout, quota): do not ask twice.
    renewing: bool,
}

impl Live {
    /// Most publishes handed over and not yet answered: the window, and the queue behind it
    /// except while probing (one at a time means one handed over).
    fn hand_over_limit(&self, probing: bool) -> usize {
        if probing {
            self.window
        } else {
            self.window + self.queue
        }
    }
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
        self.rows().any(|r| r.expires_at.is_some_and(|t| t <= now))
    }

    /// Whether a row of it has a lifetime: such a publish is never queued behind the broker's
    /// receive maximum, where it could wait past its expiry and its expiry interval would count
    /// from too early.
    fn has_lifetime(&self) -> bool {
        self.rows().any(|r| r.expires_at.is_some())
    }

    /// The rows it stands for: a batch's members, or the row itself (a batch's `row` is the
    /// packed publish, not one of them).
    fn rows(&self) -> impl Iterator<Item = &Ready> {
        let alone = self.members.is_none().then_some(&self.row);
        self.members.iter().flatten().chain(alone)
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
    /// This connection's quiet start held: its end with the suspect out of flight clears it (the
    /// strikes count connections in a row; and its row may be gone meanwhile).
    held: bool,
    /// Connections in a row the broker ended during their quiet start.
    quiet_drops: u32,
}

/// A read or a claim asked for and not answered yet: nothing else is decided meanwhile.
enum Awaiting {
    Read,
    /// A publish whose coalescing rows are being claimed, and the wall clock it was taken at.
    HandOver(Box<Publish>, i64),
}

impl Publish {
    /// Every row it stands for.
    fn seqs(&self) -> impl Iterator<Item = i64> + '_ {
        self.rows().map(|r| r.seq)
    }
}

/// The publishing side's state and decisions (see the module docs).
pub(crate) struct Core {
    config: RelayConfig,
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
    /// A publish made (a row taken, a batch packed) and held back, by the pace or until a slot on
    /// the wire is free (one with a lifetime, see `Publish::has_lifetime`): it goes next.
    held_back: Option<Publish>,
    /// Highest `outbox_gaps.gap_id` read so far on this connection.
    gap_cursor: i64,
    /// Gap notices handed out on this connection: token to `seq` range.
    notices: HashMap<i64, (i64, i64)>,
    /// Gap notices read but held until the rows before their range are queued, by token.
    held: BTreeMap<i64, Ready>,
    /// Rows whose expiry passed while they waited here: removed at the next read.
    expired: Vec<i64>,
    /// Coalescing rows read and not claimed yet: claimed when they are handed over, so that
    /// until then a newer value still replaces them (a batch lingering, the pace).
    unclaimed: HashSet<i64>,
    /// Highest sequence number handed over, on any connection.
    highest_submitted: i64,
    /// Rows handed over on an earlier connection and not acknowledged there: handing one over
    /// again is a resend (a possible duplicate downstream). Only those: a row that waited in a
    /// lower lane behind a higher-numbered one was never sent.
    unacked_at_cut: HashSet<Seq>,
    /// The last read found no more rows; read again only when something may have changed.
    at_end: bool,
    /// The last read failed: read again at the next idle tick, not in a tight loop.
    read_failed: bool,
    /// Batches in flight: their first row's number (the tracker's) to every row's.
    batches: HashMap<Seq, Vec<Seq>>,
    /// A partial batch waits for more rows: its first row, and until when.
    linger: Option<(Seq, Instant)>,
    /// Acknowledged rows not yet handed to the marker.
    acked: Vec<i64>,
    /// Batches of acknowledged rows handed to the marker and not yet confirmed marked, by number
    /// (counted like the marker counts them): with the rows on the wire and `acked`, the numbers
    /// a gap notice must not announce yet.
    marking: VecDeque<(u64, Vec<i64>)>,
    /// Non-empty batches handed to the marker so far.
    handed: u64,
    /// Gap rows set aside because they name such a number, by gap id: read again once it
    /// settles without an acknowledgement (an acknowledged one's is deleted with the mark).
    set_aside: BTreeMap<i64, (i64, i64)>,
    /// The row with strikes against it, if any.
    suspect: Option<Suspect>,
    /// The rows a connection ended over with no telling which one the broker choked on, each
    /// with its lane: published one at a time until each was answered (see `probe`).
    probe: BTreeMap<Seq, usize>,
    /// The lane of each publish in flight taken from a lane above 0, by its first row (lane 0
    /// is the rest): what `probe` records.
    upper_lanes: HashMap<Seq, usize>,
    /// While probing: the next publish is the cut's turn (else the lanes' own order).
    cut_turn: bool,
    /// Quota exceeded: publish nothing new until then, then renew the connection; and why.
    paused_until: Option<(Instant, String)>,
    /// A suspect stands: this connection first stays up with nothing on the wire until then. One
    /// a broker ends meanwhile (a cluster moving its queues) says the broker is unsteady, which
    /// clears the suspect; one that holds makes the suspect's next strike mean something.
    quiet_until: Option<Instant>,
    quota_backoff: Backoff,
    /// When the broker last said "quota exceeded", while that stands: a message written since
    /// and accepted clears it. One written before says nothing about the quota now.
    quota_refused_at: Option<Instant>,
    /// Topic aliases misbehaved on this broker: never use them again in this run.
    aliases_off: bool,
    /// Stopping: publish nothing new, only take the answers to what is in flight.
    stopping: bool,
    awaiting: Option<Awaiting>,
    out: VecDeque<Action>,
}

impl Core {
    pub(crate) fn new(config: RelayConfig) -> Self {
        Core {
            pacer: Pacer::new(config.pace),
            quota_backoff: Backoff::new(config.backoff_min, config.backoff_max),
            config,
            live: None,
            tracker: Tracker::default(),
            ready: Lanes::default(),
            cursor: [0; LANES],
            lane_end: [false; LANES],
            check_lanes: false,
            paced_until: None,
            held_back: None,
            gap_cursor: 0,
            notices: HashMap::new(),
            held: BTreeMap::new(),
            expired: Vec::new(),
            unclaimed: HashSet::new(),
            highest_submitted: 0,
            unacked_at_cut: HashSet::new(),
            at_end: false,
            read_failed: false,
            batches: HashMap::new(),
            linger: None,
            acked: Vec::new(),
            marking: VecDeque::new(),
            handed: 0,
            set_aside: BTreeMap::new(),
            suspect: None,
            probe: BTreeMap::new(),
            upper_lanes: HashMap::new(),
            cut_turn: true,
            paused_until: None,
            quiet_until: None,
            quota_refused_at: None,
            aliases_off: false,
            stopping: false,
            awaiting: None,
            out: VecDeque::new(),
        }
    }

    /// The next action, deciding more (reading, packing, publishing) once the queued ones are
    /// taken. `now_ms` is the wall clock in Unix ms, for expiry.
    pub(crate) fn poll(&mut self, now: Instant, now_ms: i64) -> Option<Action> {
        if self.out.is_empty() && self.awaiting.is_none() && self.can_publish() {
            self.fill_window(now, now_ms);
        }
        self.out.pop_front()
    }

    /// Acknowledged rows for the marker: once enough have gathered, or whenever `flush` (the
    /// driver has no more events waiting).
    pub(crate) fn acks_due(&mut self, flush: bool) -> Option<Vec<i64>> {
        if self.acked.is_empty() || !(flush || self.acked.len() >= ACK_BATCH) {
            return None;
        }
        let acked = std::mem::take(&mut self.acked);
        self.handed += 1;
        self.marking.push_back((self.handed, acked.clone()));
        Some(acked)
    }

    /// The marker has committed the first `marked` non-empty batches handed to it.
    pub(crate) fn on_marked(&mut self, marked: u64) {
        let before = self.marking.len();
        while self.marking.front().is_some_and(|(n, _)| *n <= marked) {
            self.marking.pop_front();
        }
        // Their numbers no longer settle: a gap row set aside for one of them may be read now
        // (the marker's commit itself is not news to the publisher).
        if self.marking.len() < before {
            self.settled();
        }
    }

    /// A new connection, with what its CONNACK granted. A clean session: nothing queued for the
    /// old connection survives, so publishing resumes from the oldest row not yet acknowledged,
    /// once every acknowledged row is marked.
    pub(crate) fn on_connected(&mut self, granted: &Granted, now: Instant) {
        self.mark_all();
        self.forget_in_flight();
        self.clear_ready();
        self.cursor = if crate::mutant::active("skip-resume") {
            [self.highest_submitted; LANES]
        } else {
            [0; LANES]
        };
        self.lane_end = [false; LANES];
        self.held_back = None;
        self.gap_cursor = 0;
        self.set_aside.clear();
        self.notices.clear();
        self.held.clear();
        self.at_end = false;
        self.awaiting = None;
        let cfg = &self.config;
        let full_window = granted.receive_max.map_or(cfg.max_in_flight, |m| {
            cfg.max_in_flight.min(usize::from(m).max(1))
        });
        // Up to our window, whatever the broker's: an alarm committed during a drain waits
        // behind at most `max_in_flight` publishes, on the wire or queued. None in a shared
        // session: rumqttc takes no request at all while the wire is full, so the commands'
        // PUBACKs would wait behind the queue too.
        let queue = if cfg.shares_session() {
            0
        } else {
            cfg.max_in_flight - full_window
        };
        let ours = cfg.mqtt.packet_limit();
        let (max_packet, limit_owner) = match granted.max_packet_size {
            Some(theirs) if (theirs as usize) < ours => (theirs as usize, "the broker's maximum packet size"),
            _ => match cfg.mqtt.cloud_profile() {
                Some(cloud) if cloud.max_message_bytes() == ours => (ours, cloud.message_limit_name()),
                _ => (ours, "MqttConfig::max_packet_size"),
            },
        };
        let aliases = match (cfg.mqtt.version(), granted.topic_alias_max) {
            (Protocol::V5, Some(max)) if max > 0 && cfg.mqtt.uses_topic_aliases() && !self.aliases_off => {
                Aliases::up_to(max)
            }
            _ => Aliases::none(),
        };
        let window = if self.probing() {
            tracing::info!(
                "publishing one message at a time until each message in flight when the last connection ended is answered"
            );
            1
        } else {
            full_window
        };
        if full_window < cfg.max_in_flight || max_packet < ours {
            tracing::info!(
                window = full_window,
                max_packet,
                "the broker's limits apply (receive maximum, maximum packet size)"
            );
        }
        if let Some(suspect) = &mut self.suspect {
            suspect.held = false;
        }
        self.quiet_until = (self.suspect.is_some() && !crate::mutant::active("suspect-written-at-once"))
            .then(|| now + verdicts::CHOKE_WINDOW);
        if self.quiet_until.is_some() {
            tracing::info!(
                quiet = ?verdicts::CHOKE_WINDOW,
                "a message is suspected of ending connections: waiting for this one to hold before publishing it again"
            );
        }
        self.live = Some(Live {
            newest_answered: None,
            window,
            full_window,
            queue,
            max_packet,
            limit_owner,
            aliases,
            renewing: false,
        });
    }

    /// rumqttc wrote packet `pkid` (the next row handed over, or a parked one) at `now`.
    pub(crate) fn on_published(&mut self, pkid: u16, now: Instant) {
        self.tracker.on_publish(pkid, now);
    }

    /// rumqttc parked the next row handed over: its packet id `pkid` is still in use.
    pub(crate) fn on_await_ack(&mut self, pkid: u16) {
        self.tracker.on_await_ack(pkid);
    }

    /// The file changed (a commit, a dead letter, an expiry): read again.
    pub(crate) fn on_change(&mut self) {
        self.at_end = false;
        self.check_lanes = true;
    }

    /// The driver is idle: after a failed read, read again now.
    pub(crate) fn on_idle(&mut self) {
        if std::mem::take(&mut self.read_failed) {
            self.at_end = false;
        }
    }

    /// Publish nothing new from now on; what is in flight may still be acknowledged.
    pub(crate) fn stop(&mut self) {
        self.stopping = true;
    }

    /// The driver could not hand `failed` over: the connection is ending. It and every publish
    /// queued after it stay in the outbox for the next connection, where a row that was in
    /// flight at an earlier cut still counts as a resend.
    pub(crate) fn on_hand_over_failed(&mut self, failed: Outgoing) {
        let mut withdrawn = vec![failed];
        let queued = std::mem::take(&mut self.out);
        for action in queued {
            match action {
                Action::Publish(p) => withdrawn.push(p),
                other => self.out.push_back(other),
            }
        }
        for p in withdrawn {
            self.tracker.withdraw(p.seq);
            self.batches.remove(&p.seq);
            self.upper_lanes.remove(&p.seq);
            self.unacked_at_cut.extend(p.resent);
        }
        self.clear_ready();
        self.live = None;
        self.awaiting = None;
    }

    /// Timers: the ack timeout of the oldest row on the wire, and the end of a quota pause.
    pub(crate) fn on_tick(&mut self, now: Instant) {
        if let Some((seq, wrote)) = self.tracker.oldest_on_wire()
            && self.live.as_ref().is_some_and(|l| !l.renewing)
            && now.duration_since(wrote.at) >= self.config.ack_timeout
        {
            let cause = crate::mqtt::event::Cause::new(
                crate::mqtt::event::CauseKind::Requested,
                format!(
                    "no PUBACK within {:?} for the oldest message in flight (seq {seq})",
                    self.config.ack_timeout
                ),
            );
            self.renew(cause);
        }
        if self.quiet_until.is_some_and(|t| now >= t) {
            self.quiet_until = None;
            if let Some(suspect) = &mut self.suspect {
                suspect.held = true;
                suspect.quiet_drops = 0;
            }
        }
        if self.paused_until.as_ref().is_some_and(|(t, _)| now >= *t)
            && let Some((_, why)) = self.paused_until.take()
        {
            self.renew(crate::mqtt::event::Cause::new(
                crate::mqtt::event::CauseKind::Retry,
                format!("{why}; publishing it again"),
            ));
        }
    }

    /// When the core wants [`Core::on_tick`] or [`Core::poll`] called next, if at all: the
    /// oldest row's ack timeout (while a renewal can still be asked for), the end of a quota
    /// pause or of a pace, a lingering batch's deadline.
    pub(crate) fn next_timeout(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        let renewable = self.live.as_ref().is_some_and(|l| !l.renewing);
        if let Some((_, wrote)) = self.tracker.oldest_on_wire()
            && renewable
        {
            at(wrote.at + self.config.ack_timeout);
        }
        if let Some((until, _)) = &self.paused_until {
            at(*until);
        }
        if let Some(until) = self.quiet_until {
            at(until);
        }
        // The pace's deadline, only while a publish could follow it: during an outage, a quota
        // pause or a stop, a deadline gone by would wake the driver at once, again and again.
        if let Some(until) = self.paced_until
            && (self.can_publish() || crate::mutant::active("stale-pace-deadline"))
        {
            at(until);
        }
        // A lingering batch, while its first row is still next and it could be published (a
        // stale deadline would wake the driver at once, again and again).
        if let Some((seq, until)) = self.linger
            && self.ready.front().is_some_and(|r| r.seq == seq)
            && self.can_publish()
            && self
                .live
                .as_ref()
                .is_some_and(|l| self.tracker.in_flight() < l.hand_over_limit(self.probing()))
        {
            at(until);
        }
        next
    }

    /// Whether [`Core::poll`] could hand anything over now: connected, not paused, not stopping.
    fn can_publish(&self) -> bool {
        self.live.is_some() && !self.stopping && self.paused_until.is_none() && self.quiet_until.is_none()
    }

    /// Rows handed over and not yet acknowledged.
    pub(crate) fn in_flight(&self) -> usize {
        self.tracker.in_flight()
    }

    /// Whether a connection is up, as far as publishing knows.
    pub(crate) fn is_connected(&self) -> bool {
        self.live.is_some()
    }

    /// Whether publishing waits out a quota pause.
    pub(crate) fn is_paused(&self) -> bool {
        self.paused_until.is_some()
    }

    /// Bytes of MQTT properties a publish may carry on this connection.
    fn properties(&self) -> usize {
        match self.config.mqtt.version() {
            Protocol::V5 if self.config.format().is_json() => {
                // The payload format indicator, and the content type.
                V5_PROPERTIES + 2 + 3 + "application/json".len()
            }
            Protocol::V5 => V5_PROPERTIES,
            Protocol::V311 => 0,
        }
    }

    /// Bytes a batch's routing fields may add to its properties (see
    /// [`crate::routing_fields::Routing::batch`]).
    fn batch_routing_bytes(&self) -> usize {
        match self.config.routing_placement() {
            Some(crate::routing_fields::Placement::UserProperties) => {
                crate::routing_fields::BATCH_BYTES_BESIDE_SOURCE + self.config.source.len()
            }
            _ => 0,
        }
    }

    /// Asks for a new connection (at most once per connection).
    fn renew(&mut self, cause: crate::mqtt::event::Cause) {
        if let Some(live) = &mut self.live
            && !live.renewing
        {
            live.renewing = true;
            self.out.push_back(Action::Renew(cause));
        }
    }

    /// Hands every acknowledged row to the marker, to be waited for: after it, no number is
    /// acknowledged and unmarked.
    fn mark_all(&mut self) {
        let acked = std::mem::take(&mut self.acked);
        if !acked.is_empty() {
            self.handed += 1;
        }
        self.out.push_back(Action::MarkAll(acked));
        self.marking.clear();
    }

    /// Numbers that may be delivered and are not settled: on the wire on this connection, or
    /// acknowledged and perhaps not marked yet.
    fn settling(&self) -> Vec<(i64, i64)> {
        let on_wire = self
            .tracker
            .unacknowledged()
            .filter(|&seq| !super::gaps::is_notice(seq))
            .flat_map(|seq| match self.batches.get(&seq) {
                Some(rows) => rows.clone(),
                None => vec![seq],
            });
        let marking = self.marking.iter().flat_map(|(_, rows)| rows.iter().copied());
        ranges::merged(on_wire.chain(self.acked.iter().copied()).chain(marking))
    }

    /// A number settled (acknowledged, refused, cut): a gap row set aside may be read again.
    fn settled(&mut self) {
        if !self.set_aside.is_empty() {
            self.on_change();
        }
    }

    /// The gap rows set aside whose numbers are no longer settling, taken for a read.
    fn gaps_again(&mut self, settling: &[(i64, i64)]) -> Vec<i64> {
        let again: Vec<i64> = self
            .set_aside
            .iter()
            .filter(|(_, range)| !ranges::overlaps(settling, range.0, range.1))
            .map(|(&id, _)| id)
            .collect();
        for id in &again {
            self.set_aside.remove(id);
        }
        again
    }

    /// Forgets what was read ahead: it is read again on the next connection.
    fn clear_ready(&mut self) {
        self.ready.clear();
        self.unclaimed.clear();
    }

    fn report(&mut self, report: Report) {
        self.out.push_back(Action::Report(report));
    }

    /// The connection is gone: nothing in flight on it will be acknowledged. What may have
    /// reached the broker is remembered, so that handing it over again counts as a resend (a row
    /// still in rumqttc's queue never did).
    fn forget_in_flight(&mut self) {
        let in_flight: Vec<Seq> = self.tracker.maybe_written().collect();
        for seq in in_flight {
            match self.batches.get(&seq) {
                Some(members) => self.unacked_at_cut.extend(members),
                None if super::gaps::is_notice(seq) => {}
                None => {
                    self.unacked_at_cut.insert(seq);
                }
            }
        }
        self.tracker.reset();
        self.batches.clear();
        self.upper_lanes.clear();
    }
}
