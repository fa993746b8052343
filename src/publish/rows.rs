//! The relay's side of the database: read pending rows in order, mark acknowledged ones,
//! dead-letter the ones that can never be published.

use std::collections::VecDeque;

use rusqlite::types::ValueRef;
use rusqlite::{Connection, TransactionBehavior, params};

use crate::cbor::{self, Reader};
use crate::envelope::{Fields, MessageId, Payload, decode_headers, write_envelope};
use crate::error::Result;
use crate::routing_fields::{Placement, Routing};
use crate::store::Options;
use crate::store::epoch::Epochs;
use crate::store::gaps::{self, Removal};
use crate::time::now_ms;

/// One outbox row (or gap notice), encoded and ready to hand to rumqttc.
pub(crate) struct Ready {
    /// The outbox row's `seq`; for a gap notice, its token (see `super::gaps`).
    pub seq: i64,
    pub topic: String,
    pub envelope: Vec<u8>,
    /// When the message expires (Unix ms), for MQTT 5's message expiry interval.
    pub expires_at: Option<i64>,
    /// Its routing fields, to send as MQTT 5 user properties (with
    /// [`Placement::UserProperties`]; with the property bag they are in `topic` already).
    pub routing: Option<Box<Routing>>,
}

/// A row that cannot be published as stored.
pub(crate) struct Unpublishable {
    pub seq: i64,
    pub reason: String,
}

pub(crate) struct Encoding<'a> {
    pub source: &'a str,
    /// Which epoch each row is numbered in.
    pub epochs: &'a Epochs,
    /// Largest MQTT packet the connection allows, and whose limit it is (for the dead letter).
    pub max_packet: usize,
    pub limit_owner: &'static str,
    /// Bytes of MQTT 5 properties a publish may carry (a topic alias); 0 under 3.1.1.
    pub properties: usize,
    /// Whether topics may start with `$`.
    pub allow_dollar: bool,
    /// The cloud's topic rules, with a cloud profile: a row that breaks one is dead-lettered.
    pub cloud: Option<&'a crate::cloud_profile::TopicRules>,
    /// Where each publish's routing fields go, if it carries them.
    pub routing: Option<Placement>,
    /// CBOR or JSON envelopes.
    pub format: crate::envelope::EnvelopeFormat,
    /// Lifetimes by topic filter, for rows written without an expiry of their own.
    pub ttl: &'a [(String, std::time::Duration)],
    /// Now, in Unix ms: a row whose expiry is at or before it is expired.
    pub now_ms: i64,
    /// The file's payload schemas (see [`super::reader::Context::schemas`]).
    #[cfg(feature = "schemas")]
    pub schemas: Option<&'a crate::payload_schema::Registry>,
}

/// How much one read got.
pub(crate) struct Read {
    /// Rows read; fewer than asked means the end of the outbox.
    pub rows: usize,
    /// The last (highest) sequence number read.
    pub last_seq: Option<i64>,
}

/// Reads past `cursor`: rows whose expiry has passed are not encoded but collected in `expired`.
pub(crate) struct Sinks<'s> {
    pub ready: &'s mut VecDeque<Ready>,
    pub bad: &'s mut Vec<Unpublishable>,
    pub expired: &'s mut Vec<i64>,
    /// Coalescing rows not yet claimed: the relay claims them before publishing them.
    pub claim: &'s mut Vec<i64>,
}

/// Reads up to `limit` rows of priority `lane` after `cursor`, in sequence order, into `ready`;
/// rows that cannot be published go to `bad`.
///
/// Each read costs work in proportion to the rows it visits, never to the backlog: a higher lane
/// is read through its index, and lane 0 walks the table from its cursor over every lane's rows
/// (skipping the higher lanes' ones), so its cursor moves past them and no later read walks them
/// again. [`Read::rows`] and [`Read::last_seq`] count the rows visited.
pub(crate) fn read_after(
    conn: &Connection,
    cfg: &Encoding<'_>,
    lane: u8,
    cursor: i64,
    limit: usize,
    out: Sinks<'_>,
) -> Result<Read> {
    let mut stmt = conn.prepare_cached(&lane_query(lane, limit))?;
    let mut rows = stmt.query([cursor])?;
    let mut read = Read {
        rows: 0,
        last_seq: None,
    };
    let now = cfg.now_ms;
    while let Some(row) = rows.next()? {
        let seq: i64 = row.get(0)?;
        read.rows += 1;
        read.last_seq = Some(seq);
        if row.get::<_, i64>(10)? != i64::from(lane) {
            continue;
        }
        let expires_at = expiry(row, cfg);
        if expires_at.is_some_and(|t| t <= now) {
            out.expired.push(seq);
            continue;
        }
        if row.get::<_, Option<bool>>(9).ok().flatten() == Some(true) {
            out.claim.push(seq);
        }
        match encode_row(row, cfg) {
            Ok(r) => out.ready.push_back(Ready { expires_at, ..r }),
            Err(reason) => out.bad.push(Unpublishable { seq, reason }),
        }
    }
    Ok(read)
}

/// The read of one lane, with its limit written in.
///
/// The limit is written into the SQL, not bound: SQLite's planner reads a bound LIMIT, and
/// binding it again (even to the same value) makes it prepare the statement anew at every step.
/// It is the same on every call. A higher lane's number is written in too, beside `priority > 0`:
/// SQLite uses a partial index only for a query whose WHERE contains the index's condition as a
/// term (it does not reason that `priority = 1` implies `priority > 0`), and without that term it
/// walks the table by rowid from the cursor: every row of the backlog, at every read.
pub(crate) fn lane_query(lane: u8, limit: usize) -> String {
    let filter = if lane == 0 {
        String::new()
    } else {
        format!("priority > 0 AND priority = {lane} AND ")
    };
    format!(
        "SELECT seq, id, topic, key, payload, event_type, headers, created_at, expires_at,
                coalescing = 1 AND claimed IS NULL, priority
         FROM outbox WHERE {filter}seq > ?1 ORDER BY seq LIMIT {limit}"
    )
}

/// When the row expires: its own `expires_at`, else its topic's default lifetime from its commit.
fn expiry(row: &rusqlite::Row<'_>, cfg: &Encoding<'_>) -> Option<i64> {
    if let Some(at) = row.get::<_, Option<i64>>(8).ok().flatten() {
        return Some(at);
    }
    if cfg.ttl.is_empty() {
        return None;
    }
    let topic = match row.get_ref(2) {
        Ok(ValueRef::Text(t)) => std::str::from_utf8(t).ok()?,
        _ => return None,
    };
    let created: i64 = row.get(7).ok()?;
    cfg.ttl
        .iter()
        .find(|(filter, _)| crate::topic::filter_matches(filter, topic))
        .map(|(_, ttl)| created.saturating_add(crate::time::ms(*ttl)))
}

fn encode_row(row: &rusqlite::Row<'_>, cfg: &Encoding<'_>) -> std::result::Result<Ready, String> {
    let get = |e: rusqlite::Error| format!("unreadable row: {e}");
    let seq: i64 = row.get(0).map_err(get)?;
    let id = match row.get_ref(1).map_err(get)? {
        ValueRef::Blob(b) => MessageId::from_slice(b).map_err(|e| e.to_string())?,
        _ => return Err("id is not a 16-byte blob".into()),
    };
    let topic: String = row.get(2).map_err(get)?;
    // The cloud's rules first, whose reasons are the more precise. (The mutant publishes what
    // they refuse, and learns of it from the cloud.)
    if let Some(rules) = cfg
        .cloud
        .filter(|_| !crate::mutant::active("cloud-rules-unchecked"))
    {
        rules.check(&topic).map_err(|e| e.to_string())?;
    }
    crate::topic::check(&topic, cfg.allow_dollar).map_err(|e| e.to_string())?;
    let key: String = row.get(3).map_err(get)?;
    let payload = match row.get_ref(4).map_err(get)? {
        ValueRef::Blob(b) => {
            cbor::check_one_item(b).map_err(|e| format!("payload is not one CBOR item: {e}"))?;
            Payload::Cbor(b)
        }
        ValueRef::Text(t) => Payload::Text(std::str::from_utf8(t).map_err(|_| "payload text is not UTF-8")?),
        _ => return Err("payload is neither a CBOR blob nor text".into()),
    };
    let event_type: Option<&str> = match row.get_ref(5).map_err(get)? {
        ValueRef::Text(t) => Some(std::str::from_utf8(t).map_err(|_| "event_type is not UTF-8")?),
        ValueRef::Null => None,
        _ => return Err("event_type is not text".into()),
    };
    let headers = match row.get_ref(6).map_err(get)? {
        ValueRef::Blob(h) => {
            let mut r = Reader::new(h);
            decode_headers(&mut r).map_err(|e| format!("headers are not a CBOR map of text: {e}"))?;
            if !r.is_empty() {
                return Err("trailing bytes after the headers map".into());
            }
            Some(h)
        }
        ValueRef::Null => None,
        _ => return Err("headers are not a CBOR blob".into()),
    };
    #[cfg(feature = "schemas")]
    if let Some(registry) = cfg.schemas.filter(|r| !r.is_empty()) {
        check_schema(registry, &topic, event_type, headers, &payload)?;
    }
    let created_ms: i64 = row.get(7).map_err(get)?;
    let mut envelope = Vec::with_capacity(96);
    let (epoch, wire_seq) = cfg.epochs.locate(seq);
    let fields = Fields {
        id: &id,
        source: cfg.source,
        epoch,
        seq: wire_seq,
        key: &key,
        created_ms: u64::try_from(created_ms).unwrap_or(0),
        event_type,
        headers,
    };
    match cfg.format {
        crate::envelope::EnvelopeFormat::Json => {
            crate::envelope::json::write_envelope(&mut envelope, &fields, payload)?
        }
        _ => write_envelope(&mut envelope, &fields, payload),
    }
    let (topic, routing) = place(cfg.routing, topic, || Routing::message(&fields, cfg.format))?;
    let properties = cfg.properties + routing.as_ref().map_or(0, |r| r.property_bytes());
    // Fixed header (1), remaining length (up to 4), topic length (2), topic, packet id (2),
    // properties, payload.
    let packet = 1 + 4 + 2 + topic.len() + 2 + properties + envelope.len();
    if packet > cfg.max_packet {
        return Err(format!(
            "message needs a {packet}-byte MQTT packet, above the {}-byte limit ({})",
            cfg.max_packet, cfg.limit_owner
        ));
    }
    Ok(Ready {
        seq,
        topic,
        envelope,
        expires_at: None,
        routing,
    })
}

/// A publish's topic and the routing fields it sends as properties, for `placement`: in the
/// property bag they become part of the topic (of an events topic: IoT Hub's own `$iothub/`
/// topics take no bag). Refused when they do not fit where they go: MQTT writes a topic and each
/// property's strings with a 16-bit length.
pub(crate) fn place(
    placement: Option<Placement>,
    topic: String,
    fields: impl FnOnce() -> Routing,
) -> std::result::Result<(String, Option<Box<Routing>>), String> {
    let too_long = |what: &str, len: usize| {
        format!(
            "with its routing fields, {what} is {len} bytes, above MQTT's {} (a key or event type \
             this long cannot travel as a routing field: publish it with the fields off)",
            crate::topic::MAX_TOPIC_BYTES
        )
    };
    match placement {
        None => Ok((topic, None)),
        Some(Placement::PropertyBag) if topic.starts_with('$') => Ok((topic, None)),
        Some(Placement::UserProperties) => {
            let routing = fields();
            if let Some((name, v)) = routing
                .pairs
                .iter()
                .find(|(_, v)| v.len() > crate::topic::MAX_TOPIC_BYTES)
            {
                return Err(too_long(&format!("user property {name}"), v.len()));
            }
            Ok((topic, Some(Box::new(routing))))
        }
        Some(Placement::PropertyBag) => {
            let topic = fields().in_property_bag(&topic);
            if topic.len() > crate::topic::MAX_TOPIC_BYTES {
                return Err(too_long("the topic with its property bag", topic.len()));
            }
            Ok((topic, None))
        }
    }
}

/// Deletes (or, with a sent retention, moves to `outbox_sent`) the acknowledged rows, in one
/// transaction.
///
/// Acknowledged rows mostly form runs of consecutive sequence numbers, so they are marked one run
/// at a time (`seq BETWEEN first AND last`): one statement per run instead of one per row. A run
/// holds only acknowledged numbers, so no other row is touched.
///
/// `seqs` is sorted and deduplicated in place (no copy: after a slow disk it can be long).
pub(crate) fn mark_acked(conn: &mut Connection, options: &Options, seqs: &mut Vec<i64>) -> Result<()> {
    seqs.sort_unstable();
    seqs.dedup();
    let runs = gaps::runs(seqs);
    let half = seqs.len() / 2;
    let _turn = crate::store::gate::enter(conn, options.busy_timeout)?;
    // No fold here: deleting rows that were never counted leaves the counters' page alone, so a
    // mark writes only the outbox's own pages (see `store::counters`).
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let now = now_ms();
        let mut keep = options
            .sent_retention
            .map(|_| {
                tx.prepare_cached(&format!(
                    "INSERT OR IGNORE INTO outbox_sent
                             (seq, id, topic, key, payload, event_type, headers, created_at, sent_at,
                              sent_uptime)
                         SELECT seq, id, topic, key, payload, event_type, headers, created_at, ?3,
                                {}
                         FROM outbox WHERE seq BETWEEN ?1 AND ?2",
                    crate::store::uptime::NOW_SQL
                ))
            })
            .transpose()?;
        let mut delete = tx.prepare_cached("DELETE FROM outbox WHERE seq BETWEEN ?1 AND ?2")?;
        let mut forget_gaps =
            tx.prepare_cached("DELETE FROM outbox_gaps WHERE seq BETWEEN ?1 AND ?2 AND last_seq IS NULL")?;
        let mut done = 0;
        let mut mid_hit = false;
        for (first, last) in runs {
            if let Some(keep) = keep.as_mut() {
                keep.execute(params![first, last, now])?;
            }
            let deleted = delete.execute([first, last])?;
            if i64::try_from(deleted).unwrap_or(i64::MAX) < last - first + 1 {
                // Rows removed (evicted, expired, purged) while they were being published: they
                // were delivered after all, so their gap rows (set aside, never announced: see
                // `super::gaps::read_after`) go.
                forget_gaps.execute([first, last])?;
            }
            // Crash tests abort here, inside the transaction, once about half the rows are marked.
            done += usize::try_from(last - first + 1).unwrap_or(usize::MAX);
            if !mid_hit && done > half {
                mid_hit = true;
                crate::failpoint::hit("mid-mark");
            }
        }
    }
    tx.commit()?;
    Ok(())
}

/// A row written by another writer (the SQL contract) is checked against its schema before it
/// is published; one that does not match cannot be published, and is dead-lettered with why.
#[cfg(feature = "schemas")]
fn check_schema(
    registry: &crate::payload_schema::Registry,
    topic: &str,
    event_type: Option<&str>,
    headers: Option<&[u8]>,
    payload: &Payload<'_>,
) -> std::result::Result<(), String> {
    if crate::mutant::active("schema-unchecked-at-relay") {
        return Ok(());
    }
    let version = crate::payload_schema::headers(headers)
        .map(|h| crate::payload_schema::version_of(&h))
        .map_err(|e| format!("headers are not a CBOR map of text: {e}"))?;
    let text;
    let cbor = match payload {
        Payload::Cbor(b) => *b,
        Payload::Text(t) => {
            text = crate::envelope::to_cbor(t).map_err(|e| e.to_string())?;
            &text
        }
    };
    registry
        .check(Some(topic), event_type, version, cbor)
        .map(|_| ())
        .map_err(|v| v.to_string())
}

/// Moves rows that can never be published to the dead letters, with the reason, and records
/// each as a gap for the cloud (in the same transaction).
pub(crate) fn dead_letter(conn: &mut Connection, bad: &[Unpublishable]) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    for b in bad {
        gaps::record(&tx, b.seq, b.seq, Removal::DeadLettered, Some(&b.reason))?;
        tx.execute(
            "INSERT INTO dead_letters (origin, message_id, topic, key, payload, event_type, headers,
                                       reason, created_at, priority, coalescing, expires_at, evictable)
             SELECT 'outbox', id, topic, key, payload, event_type, headers, ?2, created_at,
                    priority, coalescing, expires_at, evictable
             FROM outbox WHERE seq = ?1",
            params![b.seq, b.reason],
        )?;
        tx.execute("DELETE FROM outbox WHERE seq = ?1", [b.seq])?;
        tracing::warn!(seq = b.seq, reason = %b.reason, "outbox row dead-lettered");
    }
    tx.commit()?;
    Ok(())
}

/// Claims coalescing rows for publishing, so a newer value no longer replaces them (see the
/// `outbox_coalesce` trigger), in one transaction. Returns the rows that were replaced between
/// the read and the claim: they must not be published (their gap is recorded).
pub(crate) fn claim(conn: &mut Connection, seqs: &[i64]) -> Result<Vec<i64>> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let mut gone = Vec::new();
    {
        let mut stmt = tx.prepare_cached("UPDATE outbox SET claimed = 1 WHERE seq = ?1")?;
        for &seq in seqs {
            if stmt.execute([seq])? == 0 {
                gone.push(seq);
            }
        }
    }
    tx.commit()?;
    Ok(gone)
}

/// Removes rows whose expiry passed before they could be published, recording the gaps.
pub(crate) fn expire(conn: &mut Connection, expired: &mut Vec<i64>) -> Result<u64> {
    expired.sort_unstable();
    expired.dedup();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let n = gaps::remove(&tx, expired, Removal::Expired, None)?;
    tx.commit()?;
    expired.clear();
    if n > 0 {
        tracing::info!(
            messages = n,
            "expired messages removed unpublished (a gap notice follows)"
        );
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::lane_query;

    /// What SQLite's planner makes of each lane's read, on a file made by this crate.
    fn plan(lane: u8) -> String {
        let dir = tempfile::tempdir().expect("temp dir");
        let outbox = crate::Outbox::open(dir.path().join("plan.db")).expect("open");
        outbox.with_connection(|conn| {
            let mut stmt = conn
                .prepare(&format!("EXPLAIN QUERY PLAN {}", lane_query(lane, 256)))
                .expect("prepare");
            let details: Vec<String> = stmt
                .query_map([0], |row| row.get::<_, String>(3))
                .expect("plan")
                .collect::<Result<_, _>>()
                .expect("plan rows");
            details.join("; ")
        })
    }

    #[test]
    fn a_higher_lane_is_read_through_its_index() {
        for lane in 1..=crate::store::MAX_PRIORITY {
            let plan = plan(lane);
            assert!(
                plan.contains("INDEX outbox_lanes (priority=? AND seq>?)"),
                "lane {lane}: {plan}"
            );
        }
    }

    #[test]
    fn the_bag_goes_on_events_topics_only_and_must_fit() {
        use crate::envelope::EnvelopeFormat;
        use crate::routing_fields::{Placement, Routing};
        let fields = |key: &str| Routing {
            pairs: vec![("key", key.to_owned())],
            content_type: EnvelopeFormat::Cbor.content_type(),
            content_encoding: None,
        };
        let bag = Some(Placement::PropertyBag);
        let (twin, _) = super::place(bag, "$iothub/twin/GET/?$rid=1".into(), || fields("k")).expect("fits");
        assert_eq!(
            twin, "$iothub/twin/GET/?$rid=1",
            "IoT Hub's own topics take no bag"
        );
        let (events, _) =
            super::place(bag, "devices/d/messages/events/".into(), || fields("k")).expect("fits");
        assert!(events.ends_with("&key=k"), "{events}");
        let long = "é".repeat(12_000);
        let refused = super::place(bag, "devices/d/messages/events/".into(), || fields(&long));
        assert!(refused.is_err_and(|e| e.contains("65535")));
        let props = Some(Placement::UserProperties);
        let refused = super::place(props, "t".into(), || fields(&"k".repeat(70_000)));
        assert!(refused.is_err_and(|e| e.contains("user property key")));
    }

    #[test]
    fn lane_0_walks_the_table_from_its_cursor() {
        let plan = plan(0);
        assert!(plan.contains("USING INTEGER PRIMARY KEY (rowid>?)"), "{plan}");
    }
}
