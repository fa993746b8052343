//! The wire form of a batch: envelope version 3, a map `{"v": 3, "batch": [+ envelope]}`, or with
//! compression `{"v": 3, "zlib": bstr}` whose bytes inflate to that same CBOR array. Each element
//! is a complete version 2 envelope as a single publish carries it, so a consumer unpacks and then
//! handles every message as if it had arrived alone. Specified in `docs/wire-format.md`.
//!
//! A distinct version, not a new key in a version 2 map: a decoder that predates batches then
//! refuses the publish by its version ("version 3 is not supported") instead of taking a batch
//! for a malformed message.

use crate::batching::{Compression, MAX_BATCH_BYTES};
use crate::cbor::{self, Reader};
use crate::error::{Error, Result};

/// The envelope version of a batch.
pub const BATCH_VERSION: u64 = 3;

/// Bytes of a batch's CBOR around its envelopes at most: the map head, `"v": 3`, the key and the
/// array (or byte string) head.
pub(crate) const BATCH_OVERHEAD: usize = 1 + 2 + 1 + 6 + 9;

/// Speed over the last few percent of ratio: levels above this shrank batches of sensor readings
/// little and cost several times the CPU (see the commit that chose the codec).
const ZLIB_LEVEL: u8 = 6;

/// Writes a batch of encoded envelopes, compressed when asked and when that makes it smaller.
pub(crate) fn write_batch<'a>(
    envelopes: impl ExactSizeIterator<Item = &'a [u8]>,
    bytes: usize,
    compression: Compression,
) -> Vec<u8> {
    let mut array = Vec::with_capacity(bytes + 9);
    cbor::write_head(&mut array, cbor::ARRAY, envelopes.len() as u64);
    for e in envelopes {
        array.extend_from_slice(e);
    }
    let mut out = Vec::with_capacity(array.len() + BATCH_OVERHEAD);
    cbor::write_head(&mut out, cbor::MAP, 2);
    cbor::write_text(&mut out, "v");
    cbor::write_head(&mut out, cbor::UINT, BATCH_VERSION);
    if compression == Compression::Zlib {
        let packed = miniz_oxide::deflate::compress_to_vec_zlib(&array, ZLIB_LEVEL);
        if packed.len() < array.len() {
            cbor::write_text(&mut out, "zlib");
            cbor::write_bytes(&mut out, &packed);
            return out;
        }
    }
    cbor::write_text(&mut out, "batch");
    out.extend_from_slice(&array);
    out
}

/// The envelopes inside a batch, or `None` when `bytes` is not a batch (any other version, or no
/// map at all: the single-envelope decoder says what is wrong with it).
pub(crate) fn unpack(bytes: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
    let mut r = Reader::new(bytes);
    let Ok(pairs) = r.map_len() else {
        return Ok(None);
    };
    let mut version = None;
    let mut plain = None;
    let mut packed = None;
    for _ in 0..pairs {
        let Ok(k) = r.text() else { return Ok(None) };
        match k {
            "v" => match r.uint() {
                Ok(v) => version = Some(v),
                Err(_) => return Ok(None),
            },
            "batch" if plain.is_none() => plain = Some(r.item()?),
            "zlib" if packed.is_none() => packed = Some(r.bytes().map_err(|e| batch_error("zlib", e))?),
            _ => {
                if r.item().is_err() {
                    return Ok(None);
                }
            }
        }
    }
    if version != Some(BATCH_VERSION) {
        return Ok(None);
    }
    if !r.is_empty() {
        return Err(Error::Decode("trailing bytes after the batch".into()));
    }
    let inflated;
    let array = match (plain, packed) {
        (Some(array), None) => array,
        (None, Some(packed)) => {
            inflated = miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(packed, MAX_BATCH_BYTES)
                .map_err(|e| {
                    Error::Decode(format!(
                        "batch field \"zlib\": does not inflate within {MAX_BATCH_BYTES} bytes: {:?}",
                        e.status
                    ))
                })?;
            inflated.as_slice()
        }
        _ => {
            return Err(Error::Decode(
                "a batch (version 3) needs exactly one of \"batch\" and \"zlib\"".into(),
            ));
        }
    };
    let mut r = Reader::new(array);
    let n = r.array_len().map_err(|e| batch_error("batch", e))?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(r.item().map_err(|e| batch_error("batch", e))?.to_vec());
    }
    if !r.is_empty() {
        return Err(Error::Decode("trailing bytes after the batch's array".into()));
    }
    Ok(Some(out))
}

fn batch_error(field: &str, e: Error) -> Error {
    let why = match e {
        Error::Decode(why) => why,
        other => other.to_string(),
    };
    Error::Decode(format!("batch field {field:?}: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_compressed_batches_unpack_to_the_same_envelopes() {
        let items: Vec<Vec<u8>> = (0..50u64)
            .map(|i| {
                let mut e = Vec::new();
                cbor::write_head(&mut e, cbor::MAP, 1);
                cbor::write_text(&mut e, "seq");
                cbor::write_head(&mut e, cbor::UINT, i);
                e
            })
            .collect();
        let total = items.iter().map(Vec::len).sum();
        for compression in [Compression::None, Compression::Zlib] {
            let bytes = write_batch(items.iter().map(Vec::as_slice), total, compression);
            assert_eq!(
                unpack(&bytes).expect("unpacks"),
                Some(items.clone()),
                "{compression:?}"
            );
        }
        let packed = write_batch(items.iter().map(Vec::as_slice), total, Compression::Zlib);
        let plain = write_batch(items.iter().map(Vec::as_slice), total, Compression::None);
        assert!(
            packed.len() < plain.len(),
            "compression shrinks repetitive envelopes"
        );
    }

    #[test]
    fn other_versions_are_not_batches_and_broken_batches_fail() {
        let mut v2 = Vec::new();
        cbor::write_head(&mut v2, cbor::MAP, 1);
        cbor::write_text(&mut v2, "v");
        cbor::write_head(&mut v2, cbor::UINT, 2);
        assert_eq!(unpack(&v2).expect("not a batch"), None);
        let mut both = Vec::new();
        cbor::write_head(&mut both, cbor::MAP, 1);
        cbor::write_text(&mut both, "v");
        cbor::write_head(&mut both, cbor::UINT, 3);
        assert!(unpack(&both).is_err(), "a batch with neither field");
        let mut bomb = Vec::new();
        cbor::write_head(&mut bomb, cbor::MAP, 2);
        cbor::write_text(&mut bomb, "v");
        cbor::write_head(&mut bomb, cbor::UINT, 3);
        cbor::write_text(&mut bomb, "zlib");
        let zeros = vec![0u8; MAX_BATCH_BYTES + 1];
        cbor::write_bytes(&mut bomb, &miniz_oxide::deflate::compress_to_vec_zlib(&zeros, 6));
        assert!(unpack(&bomb).is_err(), "inflating past the limit is refused");
    }
}
