//! Stored payloads and headers shown as JSON.
//!
//! CBOR to JSON (documented in docs/operations.md): integers stay numbers (beyond 64 bits they
//! become decimal strings), floats stay numbers (NaN and the infinities become the strings
//! `"NaN"`, `"Infinity"`, `"-Infinity"`), byte strings become `"h'0a1b'"` (CBOR diagnostic
//! notation, lowercase hex), a tag becomes `{"tag": N, "value": ...}`, and map keys that are not
//! text become their diagnostic text (`1`, `h'00'`, `true`). A TEXT payload (the SQL contract
//! allows one) is shown as the JSON string the relay sends it as.

use ciborium::Value as Cbor;
use rusqlite::types::Value as Sql;
use serde_json::{Map, Number, Value as Json};

/// A payload column as JSON: decoded CBOR, a TEXT payload as a string, NULL as null. Bytes that
/// are not exactly one CBOR item become `{"invalid_cbor": why, "hex": "..."}`, so a bad row is
/// visible rather than fatal.
pub fn column(value: Sql) -> Json {
    match value {
        Sql::Null => Json::Null,
        Sql::Text(s) => Json::String(s),
        Sql::Blob(b) => cbor(&b).unwrap_or_else(|why| {
            let mut m = Map::new();
            m.insert("invalid_cbor".into(), Json::String(why));
            m.insert("hex".into(), Json::String(hex(&b)));
            Json::Object(m)
        }),
        Sql::Integer(i) => Json::from(i),
        Sql::Real(f) => float(f),
    }
}

/// Payload size in bytes, as the outbox counts it.
pub fn column_len(value: &Sql) -> u64 {
    let n = match value {
        Sql::Blob(b) => b.len(),
        Sql::Text(s) => s.len(),
        _ => 0,
    };
    n as u64
}

/// Exactly one CBOR item, as JSON.
pub fn cbor(bytes: &[u8]) -> Result<Json, String> {
    let mut rest = bytes;
    // ciborium bounds nesting (256 levels), so hostile input cannot exhaust the stack.
    let item: Cbor = ciborium::from_reader(&mut rest).map_err(|e| not_cbor(&e))?;
    if !rest.is_empty() {
        return Err(format!("{} bytes after the first CBOR item", rest.len()));
    }
    Ok(to_json(item))
}

fn not_cbor<T: std::fmt::Debug>(e: &ciborium::de::Error<T>) -> String {
    use ciborium::de::Error as E;
    match e {
        E::Syntax(at) => format!("not CBOR: malformed at byte {at}"),
        E::Semantic(Some(at), why) => format!("not CBOR: {why} at byte {at}"),
        E::Semantic(None, why) => format!("not CBOR: {why}"),
        E::RecursionLimitExceeded => "not CBOR: nested too deeply".to_owned(),
        E::Io(e) => format!("not CBOR: truncated ({e:?})"),
    }
}

fn to_json(item: Cbor) -> Json {
    match item {
        Cbor::Integer(i) => {
            let i = i128::from(i);
            i64::try_from(i)
                .map(Json::from)
                .or_else(|_| u64::try_from(i).map(Json::from))
                .unwrap_or_else(|_| Json::String(i.to_string()))
        }
        Cbor::Float(f) => float(f),
        Cbor::Text(s) => Json::String(s),
        Cbor::Bytes(b) => Json::String(diag_bytes(&b)),
        Cbor::Bool(b) => Json::Bool(b),
        Cbor::Null => Json::Null,
        Cbor::Tag(tag, value) => {
            let mut m = Map::new();
            m.insert("tag".into(), Json::from(tag));
            m.insert("value".into(), to_json(*value));
            Json::Object(m)
        }
        Cbor::Array(items) => Json::Array(items.into_iter().map(to_json).collect()),
        Cbor::Map(pairs) => Json::Object(pairs.into_iter().map(|(k, v)| (key(k), to_json(v))).collect()),
        // ciborium's Value is non-exhaustive; nothing else is produced by its decoder today.
        other => Json::String(format!("{other:?}")),
    }
}

fn key(k: Cbor) -> String {
    match k {
        Cbor::Text(s) => s,
        Cbor::Bytes(b) => diag_bytes(&b),
        other => match to_json(other) {
            Json::String(s) => s,
            json => json.to_string(),
        },
    }
}

fn float(f: f64) -> Json {
    Number::from_f64(f).map_or_else(
        || {
            Json::String(
                if f.is_nan() {
                    "NaN"
                } else if f > 0.0 {
                    "Infinity"
                } else {
                    "-Infinity"
                }
                .into(),
            )
        },
        Json::Number,
    )
}

fn diag_bytes(b: &[u8]) -> String {
    format!("h'{}'", hex(b))
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// A message id column in UUID form (hex if it is not 16 bytes, which the schema forbids).
pub fn message_id(value: Sql) -> Json {
    match value {
        Sql::Blob(b) => {
            Json::String(edge_outbox::MessageId::from_slice(&b).map_or_else(|_| hex(&b), |id| id.to_string()))
        }
        Sql::Null => Json::Null,
        other => column(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(v: &Cbor) -> Vec<u8> {
        let mut out = Vec::new();
        ciborium::into_writer(v, &mut out).unwrap_or_default();
        out
    }

    #[test]
    fn cbor_maps_to_documented_json() {
        let v = Cbor::Map(vec![
            (Cbor::Text("n".into()), Cbor::Integer(40.into())),
            (Cbor::Text("b".into()), Cbor::Bytes(vec![0xde, 0xad])),
            (Cbor::Integer(1.into()), Cbor::Float(f64::NAN)),
            (Cbor::Text("big".into()), Cbor::Integer(u64::MAX.into())),
            (
                Cbor::Text("t".into()),
                Cbor::Tag(1, Box::new(Cbor::Integer(7.into()))),
            ),
            (
                Cbor::Text("a".into()),
                Cbor::Array(vec![Cbor::Null, Cbor::Bool(true), Cbor::Float(21.5)]),
            ),
        ]);
        let json = cbor(&encode(&v)).unwrap_or_default();
        assert_eq!(
            json,
            serde_json::json!({
                "n": 40, "b": "h'dead'", "1": "NaN", "big": u64::MAX,
                "t": {"tag": 1, "value": 7}, "a": [null, true, 21.5]
            })
        );
    }

    #[test]
    fn not_one_item_is_shown_not_fatal() {
        assert!(cbor(&[0xff]).is_err());
        assert!(cbor(&[0x01, 0x02]).unwrap_err().contains("1 bytes after"));
        let shown = column(Sql::Blob(vec![0x01, 0x02]));
        assert_eq!(shown["hex"], "0102");
        assert_eq!(column(Sql::Text("hi".into())), Json::String("hi".into()));
    }
}
