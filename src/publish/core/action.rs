//! What the publishing core asks its driver to do, and what the driver tells it back about a
//! read. The core never performs any of these itself (see [`super`]).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::mqtt::event::Cause;
use crate::publish::lanes::LANES;
use crate::publish::rows::{Ready, Unpublishable};

/// One thing for the driver to do, in the order the core returns them.
pub(crate) enum Action {
    /// Hand this publish to the MQTT client (QoS 1, not retained), then apply its reports. If it
    /// cannot be handed over, give it back with
    /// [`Core::on_hand_over_failed`](super::Core::on_hand_over_failed).
    Publish(Outgoing),
    /// Read the outbox; answer with [`Core::on_read`](super::Core::on_read) or
    /// [`Core::on_read_failed`](super::Core::on_read_failed).
    Read(ReadRequest),
    /// Claim these coalescing rows, so that no newer value replaces them while they may be on the
    /// wire; answer with the ones already gone ([`Core::on_claimed`](super::Core::on_claimed)) or
    /// [`Core::on_read_failed`](super::Core::on_read_failed).
    Claim(Vec<i64>),
    /// Hand these acknowledged rows to the marker and wait until every row handed over so far is
    /// marked: the outbox is read again from its oldest row next.
    MarkAll(Vec<i64>),
    /// Gap notices acknowledged (or given up on): hand their ranges to the marker.
    Announced(Vec<(i64, i64)>),
    /// Move these rows to the dead letters, then tell the core the file changed.
    DeadLetter(Vec<Unpublishable>, Removal),
    /// Remove these rows as expired (with their gap rows), then tell the core the file changed.
    Expire(Vec<i64>),
    /// Ask for a new connection.
    Renew(Cause),
    /// Something for the operator's status and metrics.
    Report(Report),
}

/// Why rows go to the dead letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Removal {
    /// They cannot be published as stored (too large, a bad topic, a damaged envelope).
    Unpublishable,
    /// The broker refused them with a PUBACK reason code.
    Refused,
    /// The broker kept choking on it: isolated so the rows behind it go on.
    Poison,
}

/// A publish to hand over.
pub(crate) struct Outgoing {
    /// The row's `seq` (a batch's first row's; a gap notice's token).
    pub seq: i64,
    pub topic: String,
    pub envelope: Vec<u8>,
    /// An MQTT 5 topic alias: the number, and whether the broker already knows it.
    pub alias: Option<(u16, bool)>,
    /// MQTT 5's message expiry interval, in seconds.
    pub expiry: Option<u32>,
    /// Routing fields to send as MQTT 5 user properties.
    pub routing: Option<Box<crate::routing_fields::Routing>>,
    /// Rows it stands for (0 for a gap notice), and rows handed over now, for the status: counted
    /// once it is handed over, not before (a hand-over that fails counts nothing).
    pub rows: usize,
    pub in_flight: usize,
    /// Its rows that were in flight when an earlier connection ended: resends.
    pub resent: Vec<i64>,
}

/// What to read: each lane marked in `lanes` past its cursor, and the gap rows past theirs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReadRequest {
    pub gap_cursor: i64,
    pub cursors: [i64; LANES],
    pub lanes: [bool; LANES],
    /// Rows to read per lane at most.
    pub limit: usize,
    /// Gap rows to read at most.
    pub gap_limit: usize,
    /// The connection's largest packet, whose limit it is, and the bytes of a publish's
    /// properties: what the rows are encoded for.
    pub max_packet: usize,
    pub limit_owner: &'static str,
    pub properties: usize,
    /// Now, in Unix ms: rows whose expiry has passed are not read but reported expired.
    pub now_ms: i64,
    /// Numbers that may be delivered and are not settled yet (on the wire, or acknowledged and
    /// not yet marked), as sorted disjoint ranges: a gap row naming one is set aside.
    pub settling: Vec<(i64, i64)>,
    /// Gap rows set aside earlier whose numbers settled without an acknowledgement: read again.
    pub gaps_again: Vec<i64>,
}

impl ReadRequest {
    /// Whether `first..=last` overlaps a settling number.
    pub(crate) fn is_settling(&self, first: i64, last: i64) -> bool {
        super::ranges::overlaps(&self.settling, first, last)
    }
}

/// What one read got.
#[derive(Default)]
pub(crate) struct ReadResult {
    /// Gap notices, in number order, with each one's token and `seq` range.
    pub notices: VecDeque<Ready>,
    pub ranges: HashMap<i64, (i64, i64)>,
    /// Gap rows read, the last one's id, and those set aside (see [`ReadRequest::settling`]):
    /// (gap id, first, last).
    pub gap_rows: usize,
    pub last_gap_id: Option<i64>,
    pub gaps_set_aside: Vec<(i64, i64, i64)>,
    /// By lane (for those read): the rows ready to publish, how many rows were visited, and the
    /// last one's number.
    pub lanes: [Option<LaneRead>; LANES],
    /// Rows that cannot be published, rows found expired, and coalescing rows to claim.
    pub bad: Vec<Unpublishable>,
    pub expired: Vec<i64>,
    pub claim: Vec<i64>,
}

/// One lane's read.
#[derive(Default)]
pub(crate) struct LaneRead {
    pub ready: VecDeque<Ready>,
    pub visited: usize,
    pub last_seq: Option<i64>,
}

/// A status update.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Report {
    /// A row acknowledged, with how long it waited for its PUBACK.
    Acked {
        in_flight: usize,
        latency: Option<Duration>,
    },
    /// A PUBACK that acknowledged no row (a notice's, or a refusal).
    Answered {
        in_flight: usize,
    },
    /// A gap notice acknowledged, covering this many numbers.
    GapAnnounced(i64),
    /// A gap notice given up on: its numbers reach the cloud as an unexplained gap.
    NoticeLost(String),
    /// The broker asked for a pause (quota); cleared by the next accepted PUBACK.
    Quota(String),
    QuotaCleared,
}
