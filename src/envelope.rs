//! The wire format: a CBOR map around each message, and the message id.
//!
//! Specified in CDDL in `docs/wire-format.md`. Keys are short text strings written in a fixed
//! order; decoders accept any order and ignore keys they do not know, so later versions can add
//! optional fields without breaking consumers. The relay can also publish the same fields as JSON
//! (`json`), which the decoders of published items read too.

pub(crate) mod json;
pub use json::EnvelopeFormat;

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::cbor::{self, Reader};
use crate::error::{Error, Result};

/// The UUID namespace of [`MessageId::from_key`]: `6f1d3b1e-2c4a-5e0b-9d7f-0e6d9b6c4a21`.
pub const ID_NAMESPACE: [u8; 16] = [
    0x6f, 0x1d, 0x3b, 0x1e, 0x2c, 0x4a, 0x5e, 0x0b, 0x9d, 0x7f, 0x0e, 0x6d, 0x9b, 0x6c, 0x4a, 0x21,
];

/// The envelope version this build writes for a message that carries an epoch (everything a
/// relay publishes, and gap notices). Decoders refuse versions they do not know.
pub const ENVELOPE_VERSION: u64 = 2;

/// The version written for an envelope without an epoch (a command built by a cloud-side
/// sender): version 1 has no `ep`, so devices running an older build still read it. This build
/// reads both.
pub const ENVELOPE_VERSION_NO_EPOCH: u64 = 1;

/// A message's identity: 16 bytes, minted once inside the writing transaction (UUIDv7 when the
/// crate mints it) and unchanged across every resend. Consumers deduplicate on it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageId([u8; 16]);

impl MessageId {
    /// A new UUIDv7: a millisecond timestamp followed by random bits, so ids minted later sort
    /// later and index cheaply.
    pub fn new_v7() -> Self {
        MessageId(uuid::Uuid::now_v7().into_bytes())
    }

    /// A stable id derived from a caller's idempotency key (e.g. a request id a client resends):
    /// the same `key` always gives the same id. It is the UUIDv5 of `key` in the edge-outbox
    /// namespace ([`ID_NAMESPACE`]), so any UUID library can compute it too.
    pub fn from_key(key: &str) -> Self {
        MessageId(uuid::Uuid::new_v5(&uuid::Uuid::from_bytes(ID_NAMESPACE), key.as_bytes()).into_bytes())
    }

    /// The id from its 16 bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        MessageId(bytes)
    }

    /// The id from a slice, which must be exactly 16 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        bytes
            .try_into()
            .map(MessageId)
            .map_err(|_| Error::Decode(format!("message id must be 16 bytes, got {}", bytes.len())))
    }

    /// The 16 bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for MessageId {
    /// The hyphenated UUID form, e.g. `0190f3a4-7b2c-7d3e-8f00-0123456789ab`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        uuid::Uuid::from_bytes(self.0).hyphenated().fmt(f)
    }
}

impl fmt::Debug for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MessageId({self})")
    }
}

impl FromStr for MessageId {
    type Err = Error;

    /// Parses the hyphenated or plain 32-digit hex form.
    fn from_str(s: &str) -> Result<Self> {
        uuid::Uuid::parse_str(s)
            .map(|u| MessageId(u.into_bytes()))
            .map_err(|e| Error::Decode(format!("invalid message id {s:?}: {e}")))
    }
}

/// One message as it travels over MQTT.
///
/// Borrowed fields let the relay encode straight from a database row; [`Envelope::decode`]
/// returns an owned `Envelope<'static>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope<'a> {
    /// The message id (wire key `id`).
    pub id: MessageId,
    /// Who sent it: the device or relay name (wire key `src`; empty when absent).
    pub source: Cow<'a, str>,
    /// The sender's epoch (wire key `ep`; 0 when absent, as in commands and version 1
    /// envelopes): a random number minted when the sender's database was created (again when it
    /// was restored from a copy or salvaged). Within one (`source`, `epoch`), `seq` counts 1, 2,
    /// 3, ... with no gap the sender does not announce (see [`GapNotice`]).
    pub epoch: u64,
    /// The sender's sequence number within its epoch: commit order in the sender's outbox (wire
    /// key `seq`; 0 when absent).
    pub seq: u64,
    /// The ordering key: messages with the same key are published in commit order (wire key `key`).
    pub key: Cow<'a, str>,
    /// When the message was written (the insert, inside its transaction: not the commit),
    /// milliseconds since the Unix epoch by the sender's wall clock (wire key `ts`; 0 when absent).
    pub created_ms: u64,
    /// The event type, e.g. `"OrderPlaced.v2"` (wire key `type`, optional).
    pub event_type: Option<Cow<'a, str>>,
    /// Free-form text headers such as a trace id or schema version (wire key `hdr`, optional).
    pub headers: Vec<(Cow<'a, str>, Cow<'a, str>)>,
    /// The payload: exactly one CBOR item, embedded as is (wire key `p`).
    pub payload: Cow<'a, [u8]>,
}

impl Envelope<'static> {
    /// A command for a device, as a cloud-side sender in Rust builds it: `payload` serialised to
    /// CBOR, `ts` set to now, no source, sequence number, type or headers (set the public fields
    /// for those). Reuse the same `id` when you resend the command: the device's inbox applies
    /// an id once. Commands with the same `key` are applied in the order they arrive.
    ///
    /// ```
    /// use edge_outbox::{Envelope, MessageId};
    ///
    /// #[derive(serde::Serialize)]
    /// struct SetRate {
    ///     litres_per_min: f64,
    /// }
    ///
    /// let id = MessageId::from_key("order-4711/set-rate"); // stable across the sender's retries
    /// let mut command = Envelope::command(id, "pump-17", &SetRate { litres_per_min: 12.5 })?;
    /// command.event_type = Some("SetRate.v1".into());
    /// let bytes = command.encode(); // publish these on the device's command topic, QoS 1
    /// assert_eq!(Envelope::decode(&bytes)?.id, id);
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn command<T: Serialize + ?Sized>(id: MessageId, key: &str, payload: &T) -> Result<Self> {
        Ok(Envelope {
            id,
            source: Cow::Borrowed(""),
            epoch: 0,
            seq: 0,
            key: Cow::Owned(key.to_owned()),
            created_ms: u64::try_from(crate::time::now_ms()).unwrap_or(0),
            event_type: None,
            headers: Vec::new(),
            payload: Cow::Owned(to_cbor(payload)?),
        })
    }
}

impl Envelope<'_> {
    /// Encodes the envelope, appending to `out`. The payload must be one well-formed CBOR item.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let headers = (!self.headers.is_empty()).then(|| {
            let mut h = Vec::new();
            encode_headers_into(&mut h, &self.headers);
            h
        });
        write_envelope(
            out,
            &Fields {
                id: &self.id,
                source: &self.source,
                epoch: self.epoch,
                seq: self.seq,
                key: &self.key,
                created_ms: self.created_ms,
                event_type: self.event_type.as_deref(),
                headers: headers.as_deref(),
            },
            Payload::Cbor(&self.payload),
        );
    }

    /// Encodes the envelope into a new buffer.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.payload.len());
        self.encode_into(&mut out);
        out
    }

    /// Decodes the payload into any `Deserialize` type.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T> {
        from_cbor(&self.payload)
    }

    /// Decodes an envelope (version 1 or 2). Requires `v`, `id` and `p` (and `ep` in version 2);
    /// every other field has a default. Fails with [`Error::Decode`] on anything else: bad CBOR,
    /// a wrong type, an unknown version, duplicate keys, trailing bytes, a gap notice (decode
    /// those with [`Published::decode`]). The message names the field at fault, and says so when
    /// the bytes are JSON or plain text rather than CBOR.
    ///
    /// The work is linear in the input: each key is compared with the keys before it through a
    /// hash set, never one by one, so a map of many unknown keys costs one pass.
    pub fn decode(bytes: &[u8]) -> Result<Envelope<'static>> {
        match decode_counting(bytes, &Cell::new(0))? {
            Published::Message(env) => Ok(env),
            Published::Gap(gap) => Err(Error::Decode(format!(
                "this is a gap notice (seq {} to {} of {:?}, {}), not a message: decode the \
                 stream with Published::decode",
                gap.first, gap.last, gap.source, gap.cause
            ))),
        }
    }
}

/// Why a sender removed messages before publishing them (the `cause` of a [`GapNotice`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GapCause {
    /// Evicted to make room under a storage limit (`OnFull::EvictOldest`).
    Evicted,
    /// Its expiry passed before it could be published (`Message::expires_after`).
    Expired,
    /// Moved to the dead letters: unpublishable as stored, refused by the broker, or isolated as
    /// poison (the notice's `why` says which). Retrying it publishes it again under a new `seq`.
    DeadLettered,
    /// Removed by an operator (`Outbox::purge_pending`, `edge-outbox purge`).
    Purged,
    /// Lost to a damaged database file: the salvage could not read these sequence numbers. Some
    /// of them may have been published before the damage; a consumer counts only the ones it
    /// did not get.
    Unrecoverable,
    /// Replaced before it was published by a newer message of its topic and key marked
    /// coalescing (`Message::coalescing`): the newer value is on its way.
    Coalesced,
    /// A cause this build does not know (a newer sender).
    Other(String),
}

impl GapCause {
    /// The wire name: `evicted`, `expired`, `dead-lettered`, `purged`, `unrecoverable`,
    /// `coalesced`.
    pub fn as_str(&self) -> &str {
        match self {
            GapCause::Evicted => "evicted",
            GapCause::Expired => "expired",
            GapCause::DeadLettered => "dead-lettered",
            GapCause::Purged => "purged",
            GapCause::Unrecoverable => "unrecoverable",
            GapCause::Coalesced => "coalesced",
            GapCause::Other(other) => other,
        }
    }

    /// The cause with this wire name.
    pub fn parse(name: &str) -> GapCause {
        match name {
            "evicted" => GapCause::Evicted,
            "expired" => GapCause::Expired,
            "dead-lettered" => GapCause::DeadLettered,
            "purged" => GapCause::Purged,
            "unrecoverable" => GapCause::Unrecoverable,
            "coalesced" => GapCause::Coalesced,
            other => GapCause::Other(other.to_owned()),
        }
    }
}

impl fmt::Display for GapCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A sender's announcement that sequence numbers `first..=last` of (`source`, `epoch`) will never
/// be published, and why. The relay publishes one, in the message stream, for every message the
/// device removed before it was published; a consumer that sees a gap without a notice has lost
/// messages after the device handed them to the broker (see `docs/reliability.md`).
///
/// Published on the topic of the first message it covers (wire key `gap`, envelope version 2).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GapNotice {
    /// The notice's own id: the same on every resend of the same notice.
    pub id: MessageId,
    /// The sender (wire key `src`).
    pub source: String,
    /// The epoch the range belongs to (wire key `ep`).
    pub epoch: u64,
    /// First sequence number removed.
    pub first: u64,
    /// Last sequence number removed (inclusive).
    pub last: u64,
    /// Why.
    pub cause: GapCause,
    /// Details, e.g. a dead letter's reason.
    pub why: Option<String>,
    /// When the first of them was removed, Unix milliseconds (wire key `ts`).
    pub created_ms: u64,
}

impl GapNotice {
    /// A notice for `first..=last` of (`source`, `epoch`), with the id every sender of this exact
    /// notice mints ([`GapNotice::id_for`]).
    pub fn new(source: &str, epoch: u64, first: u64, last: u64, cause: GapCause) -> Self {
        GapNotice {
            id: Self::id_for(epoch, first, last, &cause),
            source: source.to_owned(),
            epoch,
            first,
            last,
            cause,
            why: None,
            created_ms: 0,
        }
    }

    /// The id of the notice for this range and cause: a UUIDv5 in [`ID_NAMESPACE`], so a notice
    /// published again (after a reconnect) has the same id.
    pub fn id_for(epoch: u64, first: u64, last: u64, cause: &GapCause) -> MessageId {
        MessageId::from_key(&format!("edge-outbox gap {epoch} {first} {last} {cause}"))
    }

    /// How many sequence numbers it covers.
    pub fn len(&self) -> u64 {
        self.last.saturating_sub(self.first).saturating_add(1)
    }

    /// Never true: a notice covers at least one sequence number.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Encodes the notice.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(96);
        write_gap_notice(
            &mut out,
            &GapFields {
                id: &self.id,
                source: &self.source,
                epoch: self.epoch,
                first: self.first,
                last: self.last,
                cause: self.cause.as_str(),
                why: self.why.as_deref(),
                created_ms: self.created_ms,
            },
        );
        out
    }
}

/// One item of a sender's stream: a message, or a gap notice.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Published {
    /// A message.
    Message(Envelope<'static>),
    /// Sequence numbers the sender will never publish, and why.
    Gap(GapNotice),
}

impl Published {
    /// Decodes what a relay published: an envelope (version 1 or 2) or a gap notice, in CBOR or
    /// in JSON ([`EnvelopeFormat::Json`], told apart by the first byte). Errors as
    /// [`Envelope::decode`]. ([`Envelope::decode`] itself, which the inbox uses for commands,
    /// reads CBOR only.)
    ///
    /// ```
    /// use edge_outbox::envelope::{GapCause, GapNotice, Published};
    ///
    /// let notice = GapNotice::new("pump-17", 42, 7, 9, GapCause::Evicted);
    /// match Published::decode(&notice.encode())? {
    ///     Published::Gap(gap) => assert_eq!((gap.first, gap.last), (7, 9)),
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn decode(bytes: &[u8]) -> Result<Published> {
        if json::is_json(bytes) {
            return decode_counting(&json::to_cbor(bytes)?, &Cell::new(0));
        }
        decode_counting(bytes, &Cell::new(0))
    }

    /// Decodes one publish into the items it carries, in order: one for an envelope or a gap
    /// notice, every message of a batch (envelope version 3, compressed or not: see
    /// [`RelayConfig::batch`](crate::RelayConfig::batch)). Each element of a batch is a
    /// complete envelope with its own id and sequence number; feed them to a
    /// [`Consumer`](crate::consumer::Consumer) one by one. Errors as [`Envelope::decode`], for
    /// the batch and for any message in it.
    ///
    /// ```
    /// use edge_outbox::{Envelope, MessageId, Published};
    ///
    /// let single = Envelope::command(MessageId::new_v7(), "pump-17", &21.5)?;
    /// let items = Published::decode_all(&single.encode())?;
    /// assert_eq!(items, vec![Published::Message(single)]);
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn decode_all(bytes: &[u8]) -> Result<Vec<Published>> {
        if json::is_json(bytes) {
            return Published::decode_all(&json::to_cbor(bytes)?);
        }
        match crate::batch_wire::unpack(bytes)? {
            None => Ok(vec![Published::decode(bytes)?]),
            Some(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    Published::decode(item)
                        .map_err(|e| Error::Decode(format!("message {i} of the batch: {}", why(&e))))
                })
                .collect(),
        }
    }
}

/// How many key comparisons [`Envelope::decode`] made on `bytes`: a measure of its work that
/// tests can bound without timing it. Not part of the stable API.
#[doc(hidden)]
pub fn decode_key_comparisons(bytes: &[u8]) -> u64 {
    let count = Cell::new(0);
    let _ = decode_counting(bytes, &count);
    count.get()
}

/// The envelope keys this version knows, in the order an encoder writes them.
const KNOWN_KEYS: [&str; 11] = [
    "v", "id", "src", "ep", "seq", "key", "ts", "type", "hdr", "gap", "p",
];

/// A key in the duplicate check; equality counts into `comparisons`.
struct SeenKey<'a, 'c> {
    key: &'a str,
    comparisons: &'c Cell<u64>,
}

impl PartialEq for SeenKey<'_, '_> {
    fn eq(&self, other: &Self) -> bool {
        self.comparisons.set(self.comparisons.get() + 1);
        self.key == other.key
    }
}

impl Eq for SeenKey<'_, '_> {}

impl std::hash::Hash for SeenKey<'_, '_> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key.hash(state);
    }
}

fn decode_counting(bytes: &[u8], comparisons: &Cell<u64>) -> Result<Published> {
    let mut r = Reader::new(bytes);
    let pairs = r.map_len().map_err(|e| not_an_envelope(bytes, e))?;
    let mut version = None;
    let mut id = None;
    let mut payload = None;
    let mut epoch = None;
    let mut gap = None;
    let mut env = Envelope {
        id: MessageId([0; 16]),
        source: Cow::Borrowed(""),
        epoch: 0,
        seq: 0,
        key: Cow::Borrowed(""),
        created_ms: 0,
        event_type: None,
        headers: Vec::new(),
        payload: Cow::Borrowed(&[]),
    };
    // Known keys are a bit each; unknown ones go through a hash set (randomly seeded, so a sender
    // cannot pick keys that collide).
    let mut known_seen = 0u16;
    #[expect(
        clippy::mutable_key_type,
        reason = "the Cell only counts comparisons; it is not part of the hash or equality"
    )]
    let mut unknown_seen: HashSet<SeenKey<'_, '_>> = HashSet::new();
    for _ in 0..pairs {
        let k = r
            .text()
            .map_err(|e| Error::Decode(format!("an envelope key: {}", why(&e))))?;
        let fresh = match KNOWN_KEYS.iter().position(|known| *known == k) {
            Some(bit) => {
                let fresh = known_seen & (1 << bit) == 0;
                known_seen |= 1 << bit;
                fresh
            }
            None => unknown_seen.insert(SeenKey { key: k, comparisons }),
        };
        if !fresh {
            return Err(Error::Decode(format!("envelope key {k:?} appears twice")));
        }
        let field = |e: Error| field_error(k, e);
        match k {
            "v" => version = Some(r.uint().map_err(field)?),
            "id" => id = Some(decode_id(&mut r)?),
            "src" => env.source = Cow::Owned(r.text().map_err(field)?.to_owned()),
            "ep" => epoch = Some(r.uint().map_err(field)?),
            "seq" => env.seq = r.uint().map_err(field)?,
            "key" => env.key = Cow::Owned(r.text().map_err(field)?.to_owned()),
            "ts" => env.created_ms = r.uint().map_err(field)?,
            "type" => env.event_type = Some(Cow::Owned(r.text().map_err(field)?.to_owned())),
            "hdr" => env.headers = decode_headers(&mut r).map_err(field)?,
            "gap" => gap = Some(decode_gap(&mut r).map_err(field)?),
            "p" => payload = Some(r.item().map_err(field)?.to_vec()),
            _ => {
                r.item().map_err(field)?;
            }
        }
    }
    if !r.is_empty() {
        return Err(Error::Decode(format!(
            "{} trailing bytes after the envelope",
            bytes.len() - r.position()
        )));
    }
    match version {
        Some(ENVELOPE_VERSION_NO_EPOCH) => {}
        Some(ENVELOPE_VERSION) => {
            if epoch.is_none() {
                return Err(Error::Decode("envelope version 2 has no epoch (\"ep\")".into()));
            }
        }
        Some(crate::batch_wire::BATCH_VERSION) => {
            return Err(Error::Decode(
                "envelope version 3 is not supported here: it is a batch of messages, which \
                 Published::decode_all unpacks"
                    .into(),
            ));
        }
        Some(v) => {
            return Err(Error::Decode(format!(
                "envelope version {v} is not supported (this build reads \
                 {ENVELOPE_VERSION_NO_EPOCH} and {ENVELOPE_VERSION})"
            )));
        }
        None => return Err(Error::Decode("envelope has no version (\"v\")".into())),
    }
    env.epoch = epoch.unwrap_or(0);
    env.id = id.ok_or_else(|| Error::Decode("envelope has no message id (\"id\")".into()))?;
    if let Some(gap) = gap {
        if version != Some(ENVELOPE_VERSION) {
            return Err(Error::Decode(
                "a gap notice (\"gap\") needs envelope version 2".into(),
            ));
        }
        if payload.is_some() {
            return Err(Error::Decode(
                "an envelope has either a payload (\"p\") or a gap notice (\"gap\"), not both".into(),
            ));
        }
        return Ok(Published::Gap(GapNotice {
            id: env.id,
            source: env.source.into_owned(),
            epoch: env.epoch,
            first: gap.first,
            last: gap.last,
            cause: gap.cause,
            why: gap.why,
            created_ms: env.created_ms,
        }));
    }
    env.payload = Cow::Owned(payload.ok_or_else(|| Error::Decode("envelope has no payload (\"p\")".into()))?);
    Ok(Published::Message(env))
}

/// The `gap` map of a gap notice.
struct GapRange {
    first: u64,
    last: u64,
    cause: GapCause,
    why: Option<String>,
}

fn decode_gap(r: &mut Reader<'_>) -> Result<GapRange> {
    let n = r.map_len()?;
    let (mut first, mut last, mut cause, mut why) = (None, None, None, None);
    let mut seen = HashSet::new();
    for _ in 0..n {
        let k = r.text()?;
        if !seen.insert(k) {
            return Err(Error::Decode(format!("key {k:?} appears twice")));
        }
        match k {
            "first" => first = Some(r.uint()?),
            "last" => last = Some(r.uint()?),
            "cause" => cause = Some(GapCause::parse(r.text()?)),
            "why" => why = Some(r.text()?.to_owned()),
            _ => {
                r.item()?;
            }
        }
    }
    let (Some(first), Some(last), Some(cause)) = (first, last, cause) else {
        return Err(Error::Decode("needs first, last and cause".into()));
    };
    if last < first {
        return Err(Error::Decode(format!("last ({last}) is below first ({first})")));
    }
    Ok(GapRange {
        first,
        last,
        cause,
        why,
    })
}

/// The `id` field, with the fix for the usual mistake: a UUID sent as text.
fn decode_id(r: &mut Reader<'_>) -> Result<MessageId> {
    let at = r.position();
    match r.bytes() {
        Ok(b) => MessageId::from_slice(b).map_err(|e| field_error("id", e)),
        Err(e) => {
            let mut again = Reader::new(r.remaining_from(at));
            let hint = match again.text() {
                Ok(t) if t.parse::<MessageId>().is_ok() => {
                    " (this is a UUID as text: send its 16 bytes as a CBOR byte string)"
                }
                _ => " (16 bytes, e.g. a UUID's bytes)",
            };
            Err(Error::Decode(format!("envelope field \"id\": {}{hint}", why(&e))))
        }
    }
}

fn field_error(field: &str, e: Error) -> Error {
    Error::Decode(format!("envelope field {field:?}: {}", why(&e)))
}

/// The reason inside a decode error, without the "malformed input" prefix of its display.
fn why(e: &Error) -> String {
    match e {
        Error::Decode(why) => why.clone(),
        other => other.to_string(),
    }
}

/// Input whose first item is not a map: say what it looks like, since JSON text is the usual
/// first try of someone sending a command by hand.
fn not_an_envelope(bytes: &[u8], e: Error) -> Error {
    let text = std::str::from_utf8(bytes).ok().map(str::trim);
    let looks_like_json = text.is_some_and(|t| {
        (t.starts_with('{') && t.ends_with('}')) || (t.starts_with('[') && t.ends_with(']'))
    });
    if looks_like_json {
        return Error::Decode(
            "this is JSON text; commands are CBOR envelopes (a map with v, id and p), see \
             docs/wire-format.md, \"Sending a command\""
                .into(),
        );
    }
    if text.is_some_and(|t| !t.is_empty() && t.chars().all(|c| !c.is_control() || c.is_whitespace())) {
        return Error::Decode(format!(
            "this is plain text, not CBOR; commands are CBOR envelopes, see docs/wire-format.md \
             ({})",
            why(&e)
        ));
    }
    Error::Decode(format!("not an envelope: {}", why(&e)))
}

/// The envelope's fields other than the payload, borrowed.
pub(crate) struct Fields<'a> {
    pub id: &'a MessageId,
    pub source: &'a str,
    /// 0: none (written as version 1, without `ep`).
    pub epoch: u64,
    pub seq: u64,
    pub key: &'a str,
    pub created_ms: u64,
    pub event_type: Option<&'a str>,
    /// Headers already encoded as a CBOR map (as the outbox stores them).
    pub headers: Option<&'a [u8]>,
}

/// A payload as stored: one CBOR item, or text to be sent as a CBOR text string (the SQL
/// contract lets foreign writers store TEXT).
pub(crate) enum Payload<'a> {
    Cbor(&'a [u8]),
    Text(&'a str),
}

/// The one envelope writer: [`Envelope::encode_into`] and the relay both call it.
pub(crate) fn write_envelope(out: &mut Vec<u8>, f: &Fields<'_>, payload: Payload<'_>) {
    let has_epoch = f.epoch != 0;
    let pairs = 7 + u64::from(has_epoch) + u64::from(f.event_type.is_some()) + u64::from(f.headers.is_some());
    cbor::write_head(out, cbor::MAP, pairs);
    cbor::write_text(out, "v");
    let version = if has_epoch {
        ENVELOPE_VERSION
    } else {
        ENVELOPE_VERSION_NO_EPOCH
    };
    cbor::write_head(out, cbor::UINT, version);
    cbor::write_text(out, "id");
    cbor::write_bytes(out, f.id.as_bytes());
    cbor::write_text(out, "src");
    cbor::write_text(out, f.source);
    if has_epoch {
        cbor::write_text(out, "ep");
        cbor::write_head(out, cbor::UINT, f.epoch);
    }
    cbor::write_text(out, "seq");
    cbor::write_head(out, cbor::UINT, f.seq);
    cbor::write_text(out, "key");
    cbor::write_text(out, f.key);
    cbor::write_text(out, "ts");
    cbor::write_head(out, cbor::UINT, f.created_ms);
    if let Some(t) = f.event_type {
        cbor::write_text(out, "type");
        cbor::write_text(out, t);
    }
    if let Some(h) = f.headers {
        cbor::write_text(out, "hdr");
        out.extend_from_slice(h);
    }
    cbor::write_text(out, "p");
    match payload {
        Payload::Cbor(item) => out.extend_from_slice(item),
        Payload::Text(text) => cbor::write_text(out, text),
    }
}

/// A gap notice's fields, borrowed.
pub(crate) struct GapFields<'a> {
    pub id: &'a MessageId,
    pub source: &'a str,
    pub epoch: u64,
    pub first: u64,
    pub last: u64,
    pub cause: &'a str,
    pub why: Option<&'a str>,
    pub created_ms: u64,
}

/// The one gap notice writer: keys `v`, `id`, `src`, `ep`, `ts`, `gap` (`first`, `last`,
/// `cause`, `why`), in that order.
pub(crate) fn write_gap_notice(out: &mut Vec<u8>, g: &GapFields<'_>) {
    cbor::write_head(out, cbor::MAP, 6);
    cbor::write_text(out, "v");
    cbor::write_head(out, cbor::UINT, ENVELOPE_VERSION);
    cbor::write_text(out, "id");
    cbor::write_bytes(out, g.id.as_bytes());
    cbor::write_text(out, "src");
    cbor::write_text(out, g.source);
    cbor::write_text(out, "ep");
    cbor::write_head(out, cbor::UINT, g.epoch);
    cbor::write_text(out, "ts");
    cbor::write_head(out, cbor::UINT, g.created_ms);
    cbor::write_text(out, "gap");
    cbor::write_head(out, cbor::MAP, 3 + u64::from(g.why.is_some()));
    cbor::write_text(out, "first");
    cbor::write_head(out, cbor::UINT, g.first);
    cbor::write_text(out, "last");
    cbor::write_head(out, cbor::UINT, g.last);
    cbor::write_text(out, "cause");
    cbor::write_text(out, g.cause);
    if let Some(why) = g.why {
        cbor::write_text(out, "why");
        cbor::write_text(out, why);
    }
}

/// Appends headers as a CBOR map of text to text.
pub(crate) fn encode_headers_into<K: AsRef<str>, V: AsRef<str>>(out: &mut Vec<u8>, headers: &[(K, V)]) {
    cbor::write_head(out, cbor::MAP, headers.len() as u64);
    for (k, v) in headers {
        cbor::write_text(out, k.as_ref());
        cbor::write_text(out, v.as_ref());
    }
}

/// Reads a CBOR map of text to text, as written by [`encode_headers_into`].
pub(crate) fn decode_headers(r: &mut Reader<'_>) -> Result<Vec<(Cow<'static, str>, Cow<'static, str>)>> {
    let n = r.map_len()?;
    let mut headers = Vec::with_capacity(n);
    for _ in 0..n {
        let k = r.text()?.to_owned();
        let v = r.text()?.to_owned();
        headers.push((Cow::Owned(k), Cow::Owned(v)));
    }
    Ok(headers)
}

/// Serializes any value to CBOR, as [`Tx::publish`](crate::Tx::publish) does.
pub fn to_cbor<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    ciborium::into_writer(value, &mut out).map_err(|e| Error::Encode(e.to_string()))?;
    Ok(out)
}

/// Deserializes exactly one CBOR item (nesting limited, trailing bytes refused).
///
/// A whole number fills a float field where the float holds it exactly (`26` for an `f64`, as
/// JSON and Python's `cbor2` write it); a float never fills an integer field.
///
/// ```
/// let celsius: f64 = edge_outbox::envelope::from_cbor(&edge_outbox::envelope::to_cbor(&26u8)?)?;
/// assert_eq!(celsius, 26.0);
/// # Ok::<(), edge_outbox::Error>(())
/// ```
pub fn from_cbor<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    cbor::check_one_item(bytes)?;
    let native = match ciborium::de::from_reader_with_recursion_limit(bytes, cbor::MAX_DEPTH) {
        Ok(value) => return Ok(value),
        Err(e) => e,
    };
    // Only on failure: the common case pays for one decode, not two.
    if let Ok(value) =
        ciborium::de::from_reader_with_recursion_limit::<ciborium::Value, _>(bytes, cbor::MAX_DEPTH)
        && let Ok(lenient) = crate::payload_de::deserialize(&value)
    {
        return Ok(lenient);
    }
    Err(Error::Decode(format!(
        "payload does not match the expected type: {}",
        describe(native)
    )))
}

/// A decoding error in words, for an operator's eyes (not ciborium's `Debug` form).
fn describe<E: std::fmt::Display>(e: ciborium::de::Error<E>) -> String {
    match e {
        ciborium::de::Error::Semantic(_, why) => why,
        ciborium::de::Error::Syntax(at) => format!("not valid CBOR at byte {at}"),
        ciborium::de::Error::Io(e) => e.to_string(),
        ciborium::de::Error::RecursionLimitExceeded => "nested too deeply".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Envelope<'static> {
        Envelope {
            id: MessageId::new_v7(),
            source: "device-7".into(),
            epoch: 7_000_000_000_000_000_001,
            seq: 42,
            key: "order-1".into(),
            created_ms: 1_700_000_000_123,
            event_type: Some("OrderPlaced".into()),
            headers: vec![("trace-id".into(), "abc".into())],
            payload: to_cbor(&("o-1", 40u32)).expect("payload").into(),
        }
    }

    #[test]
    fn round_trips() {
        let env = sample();
        let bytes = env.encode();
        assert_eq!(Envelope::decode(&bytes).expect("decode"), env);
        let (order, amount): (String, u32) = env.payload_as().expect("payload");
        assert_eq!((order.as_str(), amount), ("o-1", 40));
    }

    #[test]
    fn ciborium_reads_the_envelope_as_a_map() {
        let bytes = sample().encode();
        let value: ciborium::Value = ciborium::from_reader(&bytes[..]).expect("generic decode");
        let map = value.as_map().expect("a map");
        assert!(
            map.iter()
                .any(|(k, v)| k.as_text() == Some("seq") && v.as_integer() == Some(42.into()))
        );
    }

    #[test]
    fn unknown_keys_are_skipped_and_missing_ones_default() {
        let mut out = Vec::new();
        cbor::write_head(&mut out, cbor::MAP, 4);
        cbor::write_text(&mut out, "v");
        cbor::write_head(&mut out, cbor::UINT, 1);
        cbor::write_text(&mut out, "future");
        cbor::write_head(&mut out, cbor::ARRAY, 0);
        cbor::write_text(&mut out, "id");
        cbor::write_bytes(&mut out, &[7; 16]);
        cbor::write_text(&mut out, "p");
        cbor::write_text(&mut out, "hi");
        let env = Envelope::decode(&out).expect("decode");
        assert_eq!(env.id, MessageId::from_bytes([7; 16]));
        assert_eq!((env.key.as_ref(), env.seq), ("", 0));
        assert_eq!(env.payload_as::<String>().expect("text"), "hi");
    }

    #[test]
    fn refuses_wrong_version_duplicates_and_missing_fields() {
        let good = sample().encode();
        let mut v3 = good.clone();
        // The version is the second byte pair: map head, "v" (0x61 0x76), then 0x02.
        assert_eq!(&v3[1..4], &[0x61, b'v', 0x02]);
        v3[3] = 0x03;
        assert!(
            Envelope::decode(&v3)
                .expect_err("v3")
                .to_string()
                .contains("version 3")
        );
        let mut no_id = Vec::new();
        cbor::write_head(&mut no_id, cbor::MAP, 2);
        cbor::write_text(&mut no_id, "v");
        cbor::write_head(&mut no_id, cbor::UINT, 1);
        cbor::write_text(&mut no_id, "p");
        cbor::write_head(&mut no_id, cbor::UINT, 1);
        assert!(
            Envelope::decode(&no_id)
                .expect_err("no id")
                .to_string()
                .contains("\"id\"")
        );
    }

    #[test]
    fn envelopes_without_an_epoch_are_version_1_and_both_versions_decode() {
        let mut env = sample();
        env.epoch = 0;
        let v1 = env.encode();
        assert_eq!(&v1[1..4], &[0x61, b'v', 0x01]);
        assert_eq!(Envelope::decode(&v1).expect("v1"), env);
        // A version 2 envelope must carry its epoch.
        let mut out = Vec::new();
        cbor::write_head(&mut out, cbor::MAP, 3);
        cbor::write_text(&mut out, "v");
        cbor::write_head(&mut out, cbor::UINT, 2);
        cbor::write_text(&mut out, "id");
        cbor::write_bytes(&mut out, &[7; 16]);
        cbor::write_text(&mut out, "p");
        cbor::write_head(&mut out, cbor::UINT, 1);
        let err = Envelope::decode(&out).expect_err("no ep");
        assert!(err.to_string().contains("\"ep\""), "{err}");
    }

    #[test]
    fn gap_notices_round_trip_and_are_not_messages() {
        let mut notice = GapNotice::new("device-7", 99, 10, 12, GapCause::DeadLettered);
        notice.why = Some("the broker refused it".into());
        notice.created_ms = 1_700_000_000_000;
        let bytes = notice.encode();
        assert_eq!(
            Published::decode(&bytes).expect("decode"),
            Published::Gap(notice.clone())
        );
        let err = Envelope::decode(&bytes).expect_err("a gap notice is no message");
        assert!(err.to_string().contains("gap notice"), "{err}");
        assert_eq!(notice.len(), 3);
        assert_eq!(
            notice.id,
            GapNotice::id_for(99, 10, 12, &GapCause::DeadLettered),
            "stable across resends"
        );
        let message = sample();
        assert_eq!(
            Published::decode(&message.encode()).expect("message"),
            Published::Message(message)
        );
    }

    #[test]
    fn a_batch_is_refused_by_decode_and_unpacked_by_decode_all() {
        let (a, mut b) = (sample(), sample());
        b.seq = 43;
        let (ea, eb) = (a.encode(), b.encode());
        for compression in [crate::Compression::None, crate::Compression::Zlib] {
            let batch = crate::batch_wire::write_batch(
                [ea.as_slice(), eb.as_slice()].into_iter(),
                ea.len() + eb.len(),
                compression,
            );
            let err = Envelope::decode(&batch).expect_err("a batch is no single envelope");
            assert!(err.to_string().contains("decode_all"), "{err}");
            assert_eq!(
                Published::decode_all(&batch).expect("unpacks"),
                vec![Published::Message(a.clone()), Published::Message(b.clone())]
            );
        }
        assert_eq!(
            Published::decode_all(&ea).expect("one envelope"),
            vec![Published::Message(a)]
        );
    }

    #[test]
    fn id_text_form_round_trips() {
        let id = MessageId::new_v7();
        assert_eq!(id.to_string().parse::<MessageId>().expect("parse"), id);
        assert!("nope".parse::<MessageId>().is_err());
    }

    #[test]
    fn ids_from_keys_are_stable_distinct_and_never_v7() {
        let a = MessageId::from_key("request-42");
        assert_eq!(a, MessageId::from_key("request-42"));
        assert_ne!(a, MessageId::from_key("request-43"));
        assert_eq!(a.as_bytes()[6] >> 4, 5);
        // Python: uuid.uuid5(uuid.UUID('6f1d3b1e-2c4a-5e0b-9d7f-0e6d9b6c4a21'), 'client-request-7')
        assert_eq!(
            MessageId::from_key("client-request-7").to_string(),
            "76613c86-85c4-5b49-843c-da74a70c4845"
        );
    }

    #[test]
    fn v7_ids_sort_by_time() {
        let a = MessageId::new_v7();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = MessageId::new_v7();
        assert!(a < b);
        assert_eq!(a.as_bytes()[6] >> 4, 7, "version nibble");
    }
}
