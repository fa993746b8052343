//! The JSON envelope: the same fields as the CBOR one, in the same order, for clouds whose rules
//! read JSON bodies (see [`EnvelopeFormat`] and docs/wire-format.md, "The JSON envelope").
//!
//! Written by the relay when asked for; read by every decoder of this crate, which tells the two
//! apart by the first byte (`{` is never the first byte of a CBOR map). Reading converts the
//! JSON to the CBOR it stands for and decodes that, so both formats are held to one decoder and
//! one set of rules.

use std::fmt;
use std::str::FromStr;

use ciborium::value::Value as Cbor;
use serde_json::{Map, Number, Value as Json};

use crate::envelope::{Fields, GapFields, MessageId, Payload};
use crate::error::{Error, Result};

/// How the relay encodes what it publishes.
///
/// ```
/// use edge_outbox::{EnvelopeFormat, MqttConfig, RelayConfig};
/// let config = RelayConfig::new(MqttConfig::new("broker.example", 8883).client_id("pump-17"))
///     .envelope_format("json".parse::<EnvelopeFormat>()?);
/// assert_eq!(config.format(), EnvelopeFormat::Json);
/// # Ok::<(), edge_outbox::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum EnvelopeFormat {
    /// CBOR (docs/wire-format.md): compact, and every payload the outbox takes.
    #[default]
    Cbor,
    /// JSON text with the same fields: `id` as a hyphenated UUID, the payload as JSON. A
    /// payload JSON cannot carry (a byte string, a tag, a map key that is not text, a number
    /// outside 64 bits, NaN or an infinity) is dead-lettered with the reason, and the cloud
    /// hears of it as a gap; [`Limits::json_payloads`](crate::Limits::json_payloads) refuses it
    /// where it is written instead.
    Json,
}

impl EnvelopeFormat {
    /// `cbor` or `json`, as `--envelope` takes it.
    pub fn name(self) -> &'static str {
        match self {
            EnvelopeFormat::Cbor => "cbor",
            EnvelopeFormat::Json => "json",
        }
    }

    /// Whether it writes text (JSON) rather than CBOR.
    pub(crate) fn is_json(self) -> bool {
        self == EnvelopeFormat::Json
    }

    /// The MIME type of what it writes.
    pub fn content_type(self) -> &'static str {
        match self {
            EnvelopeFormat::Cbor => "application/cbor",
            EnvelopeFormat::Json => "application/json",
        }
    }
}

impl fmt::Display for EnvelopeFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EnvelopeFormat {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cbor" => Ok(EnvelopeFormat::Cbor),
            "json" => Ok(EnvelopeFormat::Json),
            other => Err(Error::InvalidConfig(format!(
                "envelope format {other:?}: expected cbor or json"
            ))),
        }
    }
}

/// Writes a message's JSON envelope, or says why its payload cannot be JSON.
pub(crate) fn write_envelope(
    out: &mut Vec<u8>,
    f: &Fields<'_>,
    payload: Payload<'_>,
) -> std::result::Result<(), String> {
    let p = match payload {
        Payload::Text(t) => Json::String(t.to_owned()),
        Payload::Cbor(item) => payload_to_json(item)?,
    };
    let mut m = Map::new();
    let has_epoch = f.epoch != 0;
    let version = if has_epoch {
        crate::envelope::ENVELOPE_VERSION
    } else {
        crate::envelope::ENVELOPE_VERSION_NO_EPOCH
    };
    m.insert("v".into(), version.into());
    m.insert("id".into(), f.id.to_string().into());
    m.insert("src".into(), f.source.into());
    if has_epoch {
        m.insert("ep".into(), f.epoch.into());
    }
    m.insert("seq".into(), f.seq.into());
    m.insert("key".into(), f.key.into());
    m.insert("ts".into(), f.created_ms.into());
    if let Some(t) = f.event_type {
        m.insert("type".into(), t.into());
    }
    if let Some(h) = f.headers {
        let headers =
            crate::envelope::decode_headers(&mut crate::cbor::Reader::new(h)).map_err(|e| e.to_string())?;
        let hdr: Map<String, Json> = headers
            .into_iter()
            .map(|(k, v)| (k.into_owned(), Json::String(v.into_owned())))
            .collect();
        m.insert("hdr".into(), Json::Object(hdr));
    }
    m.insert("p".into(), p);
    serde_json::to_writer(out, &Json::Object(m)).map_err(|e| e.to_string())
}

/// Writes a gap notice's JSON: `v`, `id`, `src`, `ep`, `ts`, `gap` (`first`, `last`, `cause`,
/// `why`).
pub(crate) fn write_gap_notice(out: &mut Vec<u8>, g: &GapFields<'_>) {
    let mut gap = Map::new();
    gap.insert("first".into(), g.first.into());
    gap.insert("last".into(), g.last.into());
    gap.insert("cause".into(), g.cause.into());
    if let Some(why) = g.why {
        gap.insert("why".into(), why.into());
    }
    let mut m = Map::new();
    m.insert("v".into(), crate::envelope::ENVELOPE_VERSION.into());
    m.insert("id".into(), g.id.to_string().into());
    m.insert("src".into(), g.source.into());
    m.insert("ep".into(), g.epoch.into());
    m.insert("ts".into(), g.created_ms.into());
    m.insert("gap".into(), Json::Object(gap));
    // Writing a map of strings and numbers to a Vec cannot fail.
    let _ = serde_json::to_writer(out, &Json::Object(m));
}

/// Bytes a JSON batch adds around its members: `{"v":3,"batch":[`, `]}`, and a comma per
/// member (see [`write_batch`]).
pub(crate) const BATCH_OVERHEAD: usize = r#"{"v":3,"batch":[]}"#.len();

/// A JSON batch: `{"v":3,"batch":[...]}` holding the members' JSON envelopes as they are.
pub(crate) fn write_batch<'a>(envelopes: impl Iterator<Item = &'a [u8]>, bytes: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes + BATCH_OVERHEAD + 64);
    out.extend_from_slice(br#"{"v":3,"batch":["#);
    for (i, e) in envelopes.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(e);
    }
    out.extend_from_slice(b"]}");
    out
}

/// Whether `bytes` is JSON text (a CBOR envelope never starts with `{` or whitespace).
pub(crate) fn is_json(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .is_some_and(|&b| b == b'{')
}

/// The CBOR a JSON envelope, gap notice or batch stands for: `id` (of the item, of each member
/// of a batch) back to its 16 bytes, everything else as the JSON has it.
pub(crate) fn to_cbor(bytes: &[u8]) -> Result<Vec<u8>> {
    let json: Json =
        serde_json::from_slice(bytes).map_err(|e| Error::Decode(format!("not a JSON envelope: {e}")))?;
    let Json::Object(item) = json else {
        return Err(Error::Decode("not a JSON envelope: not an object".into()));
    };
    let mut out = Vec::with_capacity(bytes.len());
    ciborium::into_writer(&item_to_cbor(item)?, &mut out).map_err(|e| Error::Decode(e.to_string()))?;
    Ok(out)
}

fn item_to_cbor(item: Map<String, Json>) -> Result<Cbor> {
    let mut pairs = Vec::with_capacity(item.len());
    for (k, v) in item {
        let v = match (k.as_str(), v) {
            ("id", Json::String(id)) => {
                let id: MessageId = id
                    .parse()
                    .map_err(|e: Error| Error::Decode(format!("field id: {e}")))?;
                Cbor::Bytes(id.as_bytes().to_vec())
            }
            ("batch", Json::Array(members)) => Cbor::Array(
                members
                    .into_iter()
                    .map(|m| match m {
                        Json::Object(m) => item_to_cbor(m),
                        _ => Err(Error::Decode("a member of the batch is not an object".into())),
                    })
                    .collect::<Result<_>>()?,
            ),
            (_, v) => json_to_cbor(v),
        };
        pairs.push((Cbor::Text(k), v));
    }
    Ok(Cbor::Map(pairs))
}

fn json_to_cbor(v: Json) -> Cbor {
    match v {
        Json::Null => Cbor::Null,
        Json::Bool(b) => Cbor::Bool(b),
        Json::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Cbor::Integer(u.into()),
            (_, Some(i)) => Cbor::Integer(i.into()),
            _ => Cbor::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Cbor::Text(s),
        Json::Array(a) => Cbor::Array(a.into_iter().map(json_to_cbor).collect()),
        Json::Object(m) => Cbor::Map(
            m.into_iter()
                .map(|(k, v)| (Cbor::Text(k), json_to_cbor(v)))
                .collect(),
        ),
    }
}

/// A CBOR payload as JSON, or where and why it cannot be.
pub(crate) fn payload_to_json(item: &[u8]) -> std::result::Result<Json, String> {
    // Before ciborium, which reads a bignum that fits as a plain integer and `undefined` as null:
    // both would reach JSON changed instead of refused.
    let unfit =
        crate::cbor::has_tag_or_undefined(item).map_err(|e| format!("payload is not one CBOR item: {e}"))?;
    if unfit && !crate::mutant::active("json-lossy-payload") {
        return Err("the JSON envelope cannot carry this payload: it holds a tag or undefined".into());
    }
    let value: Cbor =
        ciborium::from_reader(item).map_err(|e| format!("payload is not one CBOR item: {e}"))?;
    let mut path = String::from("p");
    to_json(value, &mut path)
        .map_err(|why| format!("the JSON envelope cannot carry this payload: {why} at {path}"))
}

/// Converts `v`; on failure `path` is left naming where.
fn to_json(v: Cbor, path: &mut String) -> std::result::Result<Json, &'static str> {
    Ok(match v {
        Cbor::Null => Json::Null,
        Cbor::Bool(b) => Json::Bool(b),
        Cbor::Text(s) => Json::String(s),
        Cbor::Integer(i) => {
            let i = i128::from(i);
            match (u64::try_from(i), i64::try_from(i)) {
                (Ok(u), _) => u.into(),
                (_, Ok(n)) => n.into(),
                _ => return Err("an integer outside 64 bits"),
            }
        }
        Cbor::Float(f) if crate::mutant::active("json-lossy-payload") && !f.is_finite() => Json::Null,
        Cbor::Float(f) => Json::Number(Number::from_f64(f).ok_or("NaN or an infinity")?),
        Cbor::Bytes(b) if crate::mutant::active("json-lossy-payload") => {
            Json::String(b.iter().map(|x| format!("{x:02x}")).collect())
        }
        Cbor::Bytes(_) => return Err("a byte string"),
        Cbor::Tag(..) => return Err("a tag"),
        Cbor::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                out.push(to_json(item, path)?);
                path.truncate(len);
            }
            Json::Array(out)
        }
        Cbor::Map(pairs) => {
            let mut out = Map::with_capacity(pairs.len());
            for (k, v) in pairs {
                let Cbor::Text(k) = k else {
                    return Err("a map key that is not text");
                };
                let len = path.len();
                path.push('.');
                path.push_str(&k);
                let v = to_json(v, path)?;
                if out.insert(k, v).is_some() {
                    return Err("a key that appears twice");
                }
                path.truncate(len);
            }
            Json::Object(out)
        }
        _ => return Err("a CBOR simple value JSON has no word for"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cbor<T: serde::Serialize>(v: &T) -> Vec<u8> {
        crate::envelope::to_cbor(v).expect("cbor")
    }

    #[test]
    fn what_json_can_carry_converts_and_what_it_cannot_names_where() {
        let ok = payload_to_json(&cbor(&(1_u64, -2_i64, 1.5_f64, "x", true, Option::<u8>::None)));
        assert_eq!(ok, Ok(serde_json::json!([1, -2, 1.5, "x", true, null])));
        let bytes = payload_to_json(&cbor(&std::collections::BTreeMap::from([(
            "a",
            vec![serde_bytes_like(&[1, 2])],
        )])));
        assert_eq!(
            bytes,
            Err("the JSON envelope cannot carry this payload: a byte string at p.a[0]".into())
        );
        let nan = payload_to_json(&cbor(&f64::NAN)).expect_err("NaN");
        assert!(nan.contains("NaN"), "{nan}");
        for (cbor, what) in [
            (vec![0xc2, 0x41, 0x01], "bignum 1"),
            (vec![0x81, 0xf7], "undefined in an array"),
        ] {
            let e = payload_to_json(&cbor).expect_err(what);
            assert!(e.contains("tag or undefined"), "{what}: {e}");
        }
        // A half float whose last byte is 0xf7 is a number, not undefined.
        assert!(payload_to_json(&[0xf9, 0x3c, 0xf7]).is_ok());
        let int_key =
            payload_to_json(&cbor(&std::collections::BTreeMap::from([(1, 2)]))).expect_err("int key");
        assert!(int_key.contains("not text"), "{int_key}");
    }

    fn serde_bytes_like(b: &[u8]) -> ciborium::Value {
        ciborium::Value::Bytes(b.to_vec())
    }

    #[test]
    fn json_is_told_from_cbor_by_its_first_byte() {
        assert!(is_json(b" \n{\"v\":2}"));
        assert!(!is_json(&cbor(&std::collections::BTreeMap::from([("v", 2)]))));
        assert!(!is_json(b""));
    }
}
