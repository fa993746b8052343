//! What a checked message carries: the schema's event type and version, so the cloud knows which
//! contract a payload follows and old and new versions can be published side by side.

use std::borrow::Cow;

use super::registry::{Registry, VERSION_HEADER};
use crate::cbor::Reader;
use crate::envelope::{decode_headers, encode_headers_into};
use crate::error::Result;

/// The headers of a message as stored (a CBOR map of text), decoded; none for no blob.
pub(crate) fn headers(blob: Option<&[u8]>) -> Result<Vec<(Cow<'static, str>, Cow<'static, str>)>> {
    match blob {
        Some(h) => decode_headers(&mut Reader::new(h)),
        None => Ok(Vec::new()),
    }
}

/// The version a message names in its `schema-version` header, if it names a number.
pub(crate) fn version_of<K: AsRef<str>, V: AsRef<str>>(headers: &[(K, V)]) -> Option<u32> {
    headers
        .iter()
        .find(|(k, _)| k.as_ref() == VERSION_HEADER)
        .and_then(|(_, v)| v.as_ref().parse().ok())
}

/// The event type and encoded headers a message checked against `registry` is stored with, or
/// `None` to store it as written; `Err` when it does not match its schema.
pub(crate) fn check_and_stamp(
    registry: &Registry,
    topic: &str,
    event_type: Option<&str>,
    header_blob: Option<&[u8]>,
    payload: &[u8],
) -> Result<Option<(String, Vec<u8>)>> {
    let mut headers = headers(header_blob)?;
    let version = version_of(&headers);
    let schema = registry
        .check(Some(topic), event_type, version, payload)
        .map_err(|v| v.into_error(topic))?;
    let Some(schema) = schema else { return Ok(None) };
    if event_type == Some(schema.def.event_type.as_str()) && version == Some(schema.def.version) {
        return Ok(None);
    }
    headers.retain(|(k, _)| k != VERSION_HEADER);
    headers.push((VERSION_HEADER.into(), schema.def.version.to_string().into()));
    let mut blob = Vec::new();
    encode_headers_into(&mut blob, &headers);
    Ok(Some((schema.def.event_type.clone(), blob)))
}
