//! Bad input of every shape gets an error or a dead letter, never a panic or a stalled queue:
//! random bytes, truncated and mutated envelopes, deep nesting, absurd lengths. Valid envelopes
//! round-trip exactly.

mod common;

use std::fmt::Display;

use common::{TestResult, temp_db};
use edge_outbox::envelope::{from_cbor, to_cbor};
use edge_outbox::{Envelope, MessageId, Options, Origin, Outbox, Received, Synchronous};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// Deepest nesting the decoder accepts (docs/wire-format.md).
const MAX_DEPTH: usize = 64;

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

fn tc<T>(r: Result<T, impl Display>) -> Result<T, TestCaseError> {
    r.map_err(|e| TestCaseError::fail(e.to_string()))
}

/// A store for a whole property (NORMAL: hundreds of receives, and durability is not the point).
fn store() -> TestResult<(tempfile::TempDir, Outbox)> {
    let (dir, path) = temp_db()?;
    let outbox = Outbox::open_with(&path, Options::new().synchronous(Synchronous::Normal))?;
    Ok((dir, outbox))
}

/// Feeds `bytes` to both the decoder and `receive`, and checks they agree: what does not decode is
/// dead-lettered with the decoder's reason and the raw bytes; what decodes is stored.
fn check_receive(outbox: &Outbox, bytes: &[u8]) -> Result<(), TestCaseError> {
    let decoded = Envelope::decode(bytes);
    let before = tc(outbox.stats())?.dead_letters;
    let received = tc(outbox.receive("commands/fuzz", bytes))?;
    let after = tc(outbox.stats())?.dead_letters;
    match (&decoded, &received) {
        (
            Err(e),
            Received::DeadLettered {
                dead_letter_id,
                reason,
            },
        ) => {
            prop_assert_eq!(reason, &e.to_string());
            prop_assert!(!reason.is_empty());
            prop_assert_eq!(after, before + 1);
            let dead = tc(outbox.dead_letters(usize::MAX))?;
            let last = dead
                .last()
                .ok_or_else(|| TestCaseError::fail("no dead letter listed"))?;
            prop_assert_eq!(last.dead_letter_id, *dead_letter_id);
            prop_assert_eq!(last.origin, Origin::Inbox);
            prop_assert_eq!(last.message_id, None);
            prop_assert_eq!(last.payload.as_deref(), Some(bytes));
        }
        (Ok(env), Received::Stored(id) | Received::Duplicate(id)) => {
            prop_assert_eq!(&env.id, id);
            prop_assert_eq!(after, before);
        }
        _ => prop_assert!(false, "decode gave {:?} but receive gave {:?}", decoded, received),
    }
    Ok(())
}

fn cbor_value() -> impl Strategy<Value = ciborium::Value> {
    use ciborium::Value;
    let leaf = prop_oneof![
        any::<i64>().prop_map(|i| Value::Integer(i.into())),
        any::<u64>().prop_map(|i| Value::Integer(i.into())),
        ".{0,12}".prop_map(Value::Text),
        vec(any::<u8>(), 0..16).prop_map(Value::Bytes),
        any::<bool>().prop_map(Value::Bool),
        Just(Value::Null),
        any::<f64>().prop_map(Value::Float),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            vec((inner.clone(), inner.clone()), 0..4).prop_map(Value::Map),
            (100u64..1000, inner).prop_map(|(tag, v)| Value::Tag(tag, Box::new(v))),
        ]
    })
}

fn envelope() -> impl Strategy<Value = Envelope<'static>> {
    (
        any::<[u8; 16]>(),
        ".{0,12}",
        any::<u64>(),
        ".{0,16}",
        any::<u64>(),
        option::of(".{0,12}"),
        vec((".{0,8}", ".{0,8}"), 0..3),
        cbor_value(),
    )
        .prop_map(
            |(id, source, seq, key, created_ms, event_type, headers, payload)| Envelope {
                id: MessageId::from_bytes(id),
                source: source.into(),
                epoch: 0,
                seq,
                key: key.into(),
                created_ms,
                event_type: event_type.map(Into::into),
                headers: headers.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
                payload: to_cbor(&payload).expect("a Value always encodes").into(),
            },
        )
}

/// A CBOR head: major type and argument, in the given width (24..=27 additional info).
fn head(major: u8, width: u8, arg: u64) -> Vec<u8> {
    let mut out = vec![major << 5 | width];
    match width {
        24 => out.push(arg as u8),
        25 => out.extend_from_slice(&(arg as u16).to_be_bytes()),
        26 => out.extend_from_slice(&(arg as u32).to_be_bytes()),
        _ => out.extend_from_slice(&arg.to_be_bytes()),
    }
    out
}

fn text(s: &str) -> Vec<u8> {
    let mut out = vec![0x60 | s.len() as u8]; // short keys only
    out.extend_from_slice(s.as_bytes());
    out
}

/// A minimal envelope map `{v: 1, id: h'07..', <field>: <value>}`, plus `p: 0` unless the field
/// is `p`, with `value` spliced in raw.
fn envelope_with(field: &str, value: &[u8]) -> Vec<u8> {
    let mut out = vec![if field == "p" { 0xa3 } else { 0xa4 }];
    out.extend(text("v"));
    out.push(0x01);
    out.extend(text("id"));
    out.push(0x50);
    out.extend([7u8; 16]);
    out.extend(text(field));
    out.extend_from_slice(value);
    if field != "p" {
        out.extend(text("p"));
        out.push(0x00);
    }
    out
}

/// `depth` levels of one kind of container around a 0.
fn nested(kind: u8, depth: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..depth {
        match kind {
            0 => out.push(0x81),           // [x]
            1 => out.push(0xc1),           // 1(x)
            2 => out.extend([0xa1, 0x00]), // {0: x}
            _ => out.push(0x9f),           // [_ x]
        }
    }
    out.push(0x00);
    if kind == 3 {
        out.extend(std::iter::repeat_n(0xff, depth));
    }
    out
}

#[test]
fn valid_envelopes_round_trip() -> TestResult {
    let (_dir, outbox) = store()?;
    runner(256)
        .run(&envelope(), |env| {
            let bytes = env.encode();
            let decoded = tc(Envelope::decode(&bytes))?;
            prop_assert_eq!(&decoded, &env);
            prop_assert_eq!(decoded.encode(), bytes.clone());
            check_receive(&outbox, &bytes)
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn random_bytes_are_refused_or_dead_lettered_without_panic() -> TestResult {
    let (_dir, outbox) = store()?;
    runner(512)
        .run(&vec(any::<u8>(), 0..256), |bytes| {
            // The payload decoder must not panic either.
            let _ = from_cbor::<ciborium::Value>(&bytes);
            check_receive(&outbox, &bytes)
        })
        .map_err(|e| e.to_string())?;
    // Plain garbage cannot carry a valid version, id and payload: the dead letters grew.
    assert!(outbox.stats()?.dead_letters >= 500);
    Ok(())
}

#[test]
fn truncated_envelopes_are_always_refused() -> TestResult {
    let (_dir, outbox) = store()?;
    runner(256)
        .run(&(envelope(), any::<Index>()), |(env, cut)| {
            let bytes = env.encode();
            let prefix = &bytes[..cut.index(bytes.len())];
            prop_assert!(Envelope::decode(prefix).is_err(), "a strict prefix decoded");
            check_receive(&outbox, prefix)
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn mutated_envelopes_never_panic() -> TestResult {
    let (_dir, outbox) = store()?;
    let strategy = (
        envelope(),
        vec((any::<Index>(), any::<u8>()), 1..4),
        option::of(vec(any::<u8>(), 1..8)),
    );
    runner(512)
        .run(&strategy, |(env, edits, tail)| {
            let mut bytes = env.encode();
            for (at, byte) in edits {
                let i = at.index(bytes.len());
                bytes[i] = byte;
            }
            if let Some(tail) = tail {
                let was_valid = Envelope::decode(&bytes).is_ok();
                bytes.extend(tail);
                prop_assert!(
                    !was_valid || Envelope::decode(&bytes).is_err(),
                    "trailing bytes accepted"
                );
            }
            if let Ok(decoded) = Envelope::decode(&bytes) {
                // Whatever decodes re-encodes to something that decodes to the same envelope.
                prop_assert_eq!(tc(Envelope::decode(&decoded.encode()))?, decoded);
            }
            check_receive(&outbox, &bytes)
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn deep_nesting_is_refused_beyond_the_limit() -> TestResult {
    let (_dir, outbox) = store()?;
    runner(256)
        .run(&(0u8..4, 1usize..3000), |(kind, depth)| {
            let item = nested(kind, depth);
            // As a whole message: never an envelope.
            prop_assert!(Envelope::decode(&item).is_err());
            check_receive(&outbox, &item)?;
            // As the payload of an otherwise valid envelope: accepted up to the limit.
            let bytes = envelope_with("p", &item);
            let decoded = Envelope::decode(&bytes);
            if depth <= MAX_DEPTH {
                let env = tc(decoded)?;
                prop_assert_eq!(env.payload.as_ref(), &item[..]);
            } else {
                let err = decoded
                    .err()
                    .ok_or_else(|| TestCaseError::fail("too deep, yet decoded"))?;
                prop_assert!(err.to_string().contains("nested deeper"), "{}", err);
            }
            check_receive(&outbox, &bytes)
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn oversized_lengths_are_refused_without_allocating() -> TestResult {
    let (_dir, outbox) = store()?;
    let strategy = (2u8..6, 25u8..28, 1000u64.., 0u8..5);
    runner(256)
        .run(&strategy, |(major, width, len, place)| {
            let len = match width {
                25 => len % (1 << 16),
                26 => len % (1 << 32),
                _ => len,
            }
            .max(1000);
            let huge = head(major, width, len);
            let bytes = match place {
                0 => huge.clone(),
                1 => envelope_with("p", &huge),
                2 => envelope_with("key", &huge),
                3 => envelope_with("hdr", &huge),
                // The envelope map itself claims `len` pairs.
                _ => {
                    let mut b = head(5, width, len);
                    b.extend(&envelope_with("p", &[0x00])[1..]);
                    b
                }
            };
            let err = Envelope::decode(&bytes)
                .err()
                .ok_or_else(|| TestCaseError::fail("decoded"))?;
            prop_assert!(!err.to_string().is_empty());
            check_receive(&outbox, &bytes)
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn specific_malformed_shapes_are_dead_lettered_with_a_reason() -> TestResult {
    let (_dir, outbox) = store()?;
    let mut v2 = envelope_with("p", &[0x00]);
    v2[3] = 0x02; // version 2
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("", vec![]),
        ("expected a map", vec![0x01]),
        ("version 2", v2),
        ("appears twice", {
            let mut b = envelope_with("p", &[0x00]);
            b[0] = 0xa4;
            b.extend(text("v"));
            b.push(0x01);
            b
        }),
        ("trailing", {
            let mut b = envelope_with("p", &[0x00]);
            b.push(0x00);
            b
        }),
        ("indefinite-length map", {
            let mut b = envelope_with("p", &[0x00]);
            b[0] = 0xbf;
            b.push(0xff);
            b
        }),
        ("16 bytes", {
            let mut b = envelope_with("p", &[0x00]);
            b[7] = 0x4f; // id declared 15 bytes long
            b
        }),
        ("no payload", {
            let mut b = envelope_with("x", &[0x00]);
            b.truncate(b.len() - 3); // drop `p: 0`
            b[0] = 0xa3;
            b
        }),
    ];
    for (expected, bytes) in cases {
        match outbox.receive("commands/bad", &bytes)? {
            Received::DeadLettered { reason, .. } => {
                assert!(
                    reason.contains(expected),
                    "{bytes:02x?}: reason {reason:?} lacks {expected:?}"
                )
            }
            other => panic!("{bytes:02x?} was accepted: {other:?}"),
        }
    }
    assert_eq!(outbox.stats()?.dead_letters, 8);
    assert_eq!(outbox.stats()?.inbox_unapplied, 0);
    Ok(())
}
