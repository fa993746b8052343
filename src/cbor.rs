//! A small CBOR (RFC 8949) reader and writer for the envelope.
//!
//! The envelope carries the application's payload as an embedded CBOR item. Writing the envelope
//! by hand lets the relay splice the stored payload bytes in without decoding them, and reading it
//! by hand gives the payload back byte for byte. The reader checks well-formedness with a nesting
//! limit, so hostile input costs at most one pass and never recursion without bound.

use crate::error::{Error, Result};

/// Deepest nesting of arrays, maps and tags accepted in any item.
pub(crate) const MAX_DEPTH: usize = 64;

pub(crate) const UINT: u8 = 0;
pub(crate) const BYTES: u8 = 2;
pub(crate) const TEXT: u8 = 3;
pub(crate) const ARRAY: u8 = 4;
pub(crate) const MAP: u8 = 5;
const NEGINT: u8 = 1;
const TAG: u8 = 6;
const SIMPLE: u8 = 7;
const INDEFINITE: u8 = 31;
/// The one-byte head of `undefined` (simple value 23).
const UNDEFINED: u8 = 0xf7;

/// Appends an item head: the major type and its argument, in the shortest form.
pub(crate) fn write_head(out: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        out.push(m | arg as u8);
    } else if arg <= u64::from(u8::MAX) {
        out.extend_from_slice(&[m | 24, arg as u8]);
    } else if arg <= u64::from(u16::MAX) {
        out.push(m | 25);
        out.extend_from_slice(&(arg as u16).to_be_bytes());
    } else if arg <= u64::from(u32::MAX) {
        out.push(m | 26);
        out.extend_from_slice(&(arg as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&arg.to_be_bytes());
    }
}

pub(crate) fn write_text(out: &mut Vec<u8>, s: &str) {
    write_head(out, TEXT, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

pub(crate) fn write_bytes(out: &mut Vec<u8>, b: &[u8]) {
    write_head(out, BYTES, b.len() as u64);
    out.extend_from_slice(b);
}

/// A cursor over CBOR bytes. Every method fails with [`Error::Decode`] instead of panicking.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// A tag or `undefined` was skipped: what JSON has no form for, and a generic decoder turns
    /// into something else (a bignum into an integer, `undefined` into null).
    saw_tag_or_undefined: bool,
}

/// An item head: major type, and the argument (a length, a value, or `None` for indefinite).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Head {
    pub major: u8,
    pub arg: Option<u64>,
}

fn malformed(why: impl Into<String>) -> Error {
    Error::Decode(why.into())
}

/// What a major type is called in error messages: people read "a text string", not "type 3".
pub(crate) fn kind(major: u8) -> &'static str {
    match major {
        UINT => "an unsigned integer",
        NEGINT => "a negative integer",
        BYTES => "a byte string",
        TEXT => "a text string",
        ARRAY => "an array",
        MAP => "a map",
        TAG => "a tag",
        _ => "a float or simple value",
    }
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader {
            buf,
            pos: 0,
            saw_tag_or_undefined: false,
        }
    }

    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// The input from byte `at` on (to read an item again another way).
    pub(crate) fn remaining_from(&self, at: usize) -> &'a [u8] {
        self.buf.get(at..).unwrap_or_default()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| malformed(format!("truncated CBOR at byte {}", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn peek(&self) -> Result<u8> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| malformed(format!("truncated CBOR at byte {}", self.pos)))
    }

    pub(crate) fn head(&mut self) -> Result<Head> {
        let first = self.take(1)?[0];
        let (major, info) = (first >> 5, first & 0x1f);
        let arg = match info {
            0..=23 => Some(u64::from(info)),
            24 => Some(u64::from(self.take(1)?[0])),
            25 => Some(u64::from(u16::from_be_bytes(array(self.take(2)?)?))),
            26 => Some(u64::from(u32::from_be_bytes(array(self.take(4)?)?))),
            27 => Some(u64::from_be_bytes(array(self.take(8)?)?)),
            INDEFINITE if matches!(major, BYTES | TEXT | ARRAY | MAP | SIMPLE) => None,
            _ => return Err(malformed(format!("reserved CBOR head 0x{first:02x}"))),
        };
        if major == SIMPLE && info == 24 && arg.is_some_and(|v| v < 32) {
            return Err(malformed("CBOR simple value in two bytes below 32"));
        }
        Ok(Head { major, arg })
    }

    /// A definite length that fits in memory at all: no longer than what is left to read.
    fn length(&self, head: Head, what: &str) -> Result<usize> {
        let n = head
            .arg
            .ok_or_else(|| malformed(format!("indefinite-length {what} not allowed here")))?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.buf.len() - self.pos)
            .ok_or_else(|| malformed(format!("{what} length {n} exceeds the input")))
    }

    pub(crate) fn text(&mut self) -> Result<&'a str> {
        let head = self.head()?;
        if head.major != TEXT {
            return Err(malformed(format!(
                "expected a text string, found {}",
                kind(head.major)
            )));
        }
        let n = self.length(head, "text")?;
        std::str::from_utf8(self.take(n)?).map_err(|_| malformed("text is not UTF-8"))
    }

    pub(crate) fn bytes(&mut self) -> Result<&'a [u8]> {
        let head = self.head()?;
        if head.major != BYTES {
            return Err(malformed(format!(
                "expected a byte string, found {}",
                kind(head.major)
            )));
        }
        let n = self.length(head, "byte string")?;
        self.take(n)
    }

    pub(crate) fn uint(&mut self) -> Result<u64> {
        let head = self.head()?;
        match (head.major, head.arg) {
            (UINT, Some(v)) => Ok(v),
            _ => Err(malformed(format!(
                "expected an unsigned integer, found {}",
                kind(head.major)
            ))),
        }
    }

    /// Reads a map head and returns its number of pairs (definite lengths only).
    pub(crate) fn map_len(&mut self) -> Result<usize> {
        let head = self.head()?;
        if head.major != MAP {
            return Err(malformed(format!("expected a map, found {}", kind(head.major))));
        }
        // Each pair takes at least two bytes, which bounds a hostile length.
        let n = head
            .arg
            .ok_or_else(|| malformed("indefinite-length map not allowed here"))?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= (self.buf.len() - self.pos) / 2)
            .ok_or_else(|| malformed(format!("map of {n} pairs exceeds the input")))
    }

    /// Reads an array head and returns its number of items (definite lengths only).
    pub(crate) fn array_len(&mut self) -> Result<usize> {
        let head = self.head()?;
        if head.major != ARRAY {
            return Err(malformed(format!(
                "expected an array, found {}",
                kind(head.major)
            )));
        }
        // Each item takes at least one byte, which bounds a hostile length.
        self.length(head, "array")
    }

    /// Skips one well-formed item and returns the bytes it spanned.
    pub(crate) fn item(&mut self) -> Result<&'a [u8]> {
        let start = self.pos;
        self.skip(0)?;
        Ok(&self.buf[start..self.pos])
    }

    fn skip(&mut self, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(malformed(format!("CBOR nested deeper than {MAX_DEPTH}")));
        }
        let start = self.pos;
        let head = self.head()?;
        match (head.major, head.arg) {
            (UINT | NEGINT, _) => Ok(()),
            (BYTES | TEXT, Some(_)) => {
                let n = self.length(head, "string")?;
                if head.major == TEXT {
                    std::str::from_utf8(self.take(n)?).map_err(|_| malformed("text is not UTF-8"))?;
                } else {
                    self.take(n)?;
                }
                Ok(())
            }
            (BYTES | TEXT, None) => loop {
                if self.peek()? == 0xff {
                    self.pos += 1;
                    return Ok(());
                }
                let chunk = self.head()?;
                if chunk.major != head.major || chunk.arg.is_none() {
                    return Err(malformed("bad chunk in indefinite-length string"));
                }
                let n = self.length(chunk, "string chunk")?;
                self.take(n)?;
            },
            (ARRAY | MAP, Some(n)) => {
                let items = if head.major == MAP { n.saturating_mul(2) } else { n };
                for _ in 0..items {
                    self.skip(depth + 1)?;
                }
                Ok(())
            }
            (ARRAY | MAP, None) => {
                let mut count = 0u64;
                loop {
                    if self.peek()? == 0xff {
                        self.pos += 1;
                        if head.major == MAP && count % 2 == 1 {
                            return Err(malformed("indefinite-length map with a key and no value"));
                        }
                        return Ok(());
                    }
                    self.skip(depth + 1)?;
                    count += 1;
                }
            }
            (TAG, _) => {
                self.saw_tag_or_undefined = true;
                self.skip(depth + 1)
            }
            (SIMPLE, None) => Err(malformed("unexpected CBOR break")),
            (SIMPLE, Some(_)) if self.buf.get(start) == Some(&UNDEFINED) => {
                self.saw_tag_or_undefined = true;
                Ok(())
            }
            // Floats and simple values carry their value in the head; nothing follows.
            (SIMPLE, Some(_)) => Ok(()),
            _ => Err(malformed(format!("unknown CBOR major type {}", head.major))),
        }
    }
}

fn array<const N: usize>(s: &[u8]) -> Result<[u8; N]> {
    s.try_into().map_err(|_| malformed("truncated CBOR head"))
}

/// Whether the well-formed item `bytes` holds a tag or `undefined` anywhere.
pub(crate) fn has_tag_or_undefined(bytes: &[u8]) -> Result<bool> {
    let mut r = Reader::new(bytes);
    r.item()?;
    Ok(r.saw_tag_or_undefined)
}

/// Checks that `bytes` hold exactly one well-formed CBOR item.
pub(crate) fn check_one_item(bytes: &[u8]) -> Result<()> {
    let mut r = Reader::new(bytes);
    r.item()?;
    if !r.is_empty() {
        return Err(malformed(format!(
            "{} trailing bytes after the CBOR item",
            bytes.len() - r.position()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode<T: serde::Serialize>(v: &T) -> Vec<u8> {
        let mut out = Vec::new();
        ciborium::into_writer(v, &mut out).expect("encode");
        out
    }

    #[test]
    fn heads_round_trip_at_every_width() {
        for v in [
            0u64,
            23,
            24,
            255,
            256,
            65535,
            65536,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            write_head(&mut out, UINT, v);
            assert_eq!(out, encode(&v), "shortest form of {v}");
            assert_eq!(Reader::new(&out).uint().expect("uint"), v);
        }
    }

    #[test]
    fn skips_what_ciborium_writes() {
        use ciborium::Value;
        let int = |i: i64| Value::Integer(i.into());
        let text = |t: &str| Value::Text(t.into());
        let nested = Value::Map(vec![(
            text("n"),
            Value::Array(vec![Value::Array(vec![Value::Array(vec![])])]),
        )]);
        let value = Value::Map(vec![
            (
                text("a"),
                Value::Array(vec![
                    int(1),
                    int(-2),
                    Value::Float(3.5),
                    Value::Null,
                    Value::Bool(true),
                    text("x"),
                    nested,
                ]),
            ),
            (text("b"), Value::Bytes(vec![1, 2, 3])),
            (text("t"), Value::Tag(1, Box::new(int(5)))),
            (text("f"), Value::Float(1.0e300)),
        ]);
        let bytes = encode(&value);
        check_one_item(&bytes).expect("well-formed");
    }

    #[test]
    fn indefinite_lengths_are_well_formed() {
        // [_ 1, (_ h'01', h'02'), {_ "a": 1}]
        let bytes = [
            0x9f, 0x01, 0x5f, 0x41, 0x01, 0x41, 0x02, 0xff, 0xbf, 0x61, 0x61, 0x01, 0xff, 0xff,
        ];
        check_one_item(&bytes).expect("well-formed");
    }

    #[test]
    fn rejects_malformed_shapes() {
        let cases: &[&[u8]] = &[
            &[],
            &[0x18],                                                 // truncated argument
            &[0x62, b'a'],                                           // text shorter than declared
            &[0x1c],                                                 // reserved additional info
            &[0xff],                                                 // lone break
            &[0x81],                                                 // array missing its item
            &[0xbf, 0x01, 0xff],                                     // indefinite map with odd items
            &[0x61, 0xff],                                           // invalid UTF-8
            &[0x01, 0x02],                                           // trailing bytes
            &[0x5f, 0x61, 0x61, 0xff],                               // text chunk inside a byte string
            &[0xf8, 0x10],                                           // two-byte simple value below 32
            &[0x9b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], // absurd length
        ];
        for case in cases {
            assert!(check_one_item(case).is_err(), "accepted {case:02x?}");
        }
    }

    #[test]
    fn deep_nesting_is_refused_not_recursed() {
        let mut bytes = vec![0x81; 100_000];
        bytes.push(0x00);
        let err = check_one_item(&bytes).expect_err("too deep");
        assert!(err.to_string().contains("nested deeper"), "{err}");
    }
}
