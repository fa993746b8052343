//! The wire format is plain CBOR that a non-Rust library reads and writes: Python's `cbor2`
//! decodes what Rust encodes, field by field with the payload as a native value, and Rust decodes
//! and receives what `cbor2` encodes from a dict.

mod common;
mod support;

use common::{TestResult, from_hex, temp_db, to_hex};
use edge_outbox::envelope::to_cbor;
use edge_outbox::{ApplyOutcome, Envelope, GapCause, GapNotice, MessageId, Outbox, Published, Received};
use serde::{Deserialize, Serialize};
use support::python::run_script;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Order {
    order: String,
    total: u64,
    items: Vec<String>,
    paid: bool,
    note: Option<String>,
    celsius: f64,
    delta: i64,
}

#[derive(Debug, PartialEq, Deserialize)]
struct Credit {
    amount: u64,
    currency: String,
    lines: Vec<String>,
    rush: bool,
    note: Option<String>,
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn python_decodes_what_rust_encodes() -> TestResult {
    let payload = Order {
        order: "o-1".into(),
        total: 1250,
        items: vec!["a".into(), "b".into()],
        paid: true,
        note: None,
        celsius: 21.5,
        delta: -3,
    };
    let id = MessageId::new_v7();
    let env = Envelope {
        id,
        source: "device-7".into(),
        epoch: 7,
        seq: 42,
        key: "order-1".into(),
        created_ms: 1_767_225_600_123,
        event_type: Some("OrderPlaced.v1".into()),
        headers: vec![
            ("trace-id".into(), "4bf92f35".into()),
            ("schema".into(), "1".into()),
        ],
        payload: to_cbor(&payload)?.into(),
    };
    let out = run_script("tests/python/wire_decode.py", &[&to_hex(&env.encode())])?;
    let expected = [
        "keys v,id,src,ep,seq,key,ts,type,hdr,p".to_owned(),
        "v 2".to_owned(),
        format!("id {}", to_hex(id.as_bytes())),
        "src device-7".to_owned(),
        "ep 7".to_owned(),
        "seq 42".to_owned(),
        "key order-1".to_owned(),
        "ts 1767225600123".to_owned(),
        "type OrderPlaced.v1".to_owned(),
        r#"hdr {"schema":"1","trace-id":"4bf92f35"}"#.to_owned(),
        r#"p {"celsius":21.5,"delta":-3,"items":["a","b"],"note":null,"order":"o-1","paid":true,"total":1250}"#
            .to_owned(),
    ];
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines, expected);

    // The optional fields are absent, not null, when unset; other values keep their types.
    let bare = Envelope {
        event_type: None,
        headers: vec![],
        payload: to_cbor(&"just text")?.into(),
        seq: u64::MAX,
        ..env
    };
    let out = run_script("tests/python/wire_decode.py", &[&to_hex(&bare.encode())])?;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "keys v,id,src,ep,seq,key,ts,p");
    assert_eq!(lines[5], format!("seq {}", u64::MAX));
    assert_eq!(lines[8..], ["type None", "hdr null", r#"p "just text""#]);

    // Without an epoch (a command from the cloud): version 1, no `ep`.
    let command = Envelope { epoch: 0, ..bare };
    let out = run_script("tests/python/wire_decode.py", &[&to_hex(&command.encode())])?;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..2], ["keys v,id,src,seq,key,ts,p", "v 1"]);
    assert_eq!(lines[4], "ep None");
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn python_decodes_a_gap_notice() -> TestResult {
    let mut notice = GapNotice::new(
        "device-7",
        (1 << 62) + 5,
        1 << 33,
        (1 << 33) + 9,
        GapCause::DeadLettered,
    );
    notice.why = Some("the broker refused it: PUBACK reason 0x87 (not authorized)".into());
    notice.created_ms = 1_767_225_600_999;
    let out = run_script("tests/python/wire_decode.py", &[&to_hex(&notice.encode())])?;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "keys v,id,src,ep,ts,gap".to_owned(),
            "v 2".to_owned(),
            format!("id {}", to_hex(notice.id.as_bytes())),
            "src device-7".to_owned(),
            format!("ep {}", (1u64 << 62) + 5),
            "ts 1767225600999".to_owned(),
            format!(
                "gap {} {} dead-lettered the broker refused it: PUBACK reason 0x87 (not authorized)",
                1u64 << 33,
                (1u64 << 33) + 9
            ),
        ]
    );
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn rust_decodes_and_receives_what_python_encodes() -> TestResult {
    let id = MessageId::new_v7();
    let bytes = from_hex(&run_script(
        "tests/python/wire_encode.py",
        &[&to_hex(id.as_bytes())],
    )?)?;

    let env = Envelope::decode(&bytes)?;
    assert_eq!(env.id, id);
    assert_eq!(env.source, "python-sender");
    assert_eq!(env.seq, (1 << 40) + 3);
    assert_eq!(env.key, "account-7");
    assert_eq!(env.created_ms, 1_767_225_600_123);
    assert_eq!(env.event_type.as_deref(), Some("Credit.v2"));
    let mut headers: Vec<(&str, &str)> = env
        .headers
        .iter()
        .map(|(k, v)| (k.as_ref(), v.as_ref()))
        .collect();
    headers.sort();
    assert_eq!(headers, [("schema", "2"), ("trace-id", "4bf92f3577b34da6")]);
    let expected = Credit {
        amount: 1250,
        currency: "EUR".into(),
        lines: vec!["a".into(), "b".into()],
        rush: false,
        note: None,
    };
    assert_eq!(env.payload_as::<Credit>()?, expected);

    // Through the inbox: stored once, and the handler sees the same command.
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open(&path)?;
    assert_eq!(outbox.receive("commands/credit", &bytes)?, Received::Stored(id));
    assert_eq!(
        outbox.receive("commands/credit", &bytes)?,
        Received::Duplicate(id)
    );
    let mut seen = None;
    let outcome = outbox.apply_next(|_, cmd| {
        seen = Some((
            cmd.key.clone(),
            cmd.source.clone(),
            cmd.event_type.clone(),
            cmd.payload_as::<Credit>(),
        ));
        Ok::<_, edge_outbox::Error>(())
    })?;
    assert_eq!(outcome, ApplyOutcome::Applied { id, published: 0 });
    let (key, source, event_type, credit) = seen.ok_or("handler not called")?;
    assert_eq!(
        (key.as_str(), source.as_str(), event_type.as_deref()),
        ("account-7", "python-sender", Some("Credit.v2"))
    );
    assert_eq!(credit?, expected);
    Ok(())
}

/// The example in docs/wire-format.md is what `Envelope::encode` writes, byte for byte.
#[test]
fn the_documented_example_is_exact() -> TestResult {
    #[derive(Serialize)]
    struct Placed {
        order: &'static str,
        total: u32,
    }
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/wire-format.md"))?;
    let after_marker = doc
        .split_once("<!-- example-hex: checked by tests/wire_interop.rs -->")
        .ok_or("example marker missing from docs/wire-format.md")?
        .1;
    let hex: String = after_marker
        .lines()
        .skip_while(|l| !l.starts_with("```"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .collect();
    let documented = from_hex(&hex)?;

    let env = Envelope {
        id: "019b7a3e-5c7b-7c2a-9d4e-0f1a2b3c4d5e".parse()?,
        source: "pump-17".into(),
        epoch: 1_234_567_890_123_456_789,
        seq: 42,
        key: "order-1".into(),
        created_ms: 1_767_225_600_123,
        event_type: Some("OrderPlaced.v1".into()),
        headers: vec![("trace-id".into(), "4bf92f3577b34da6".into())],
        payload: to_cbor(&Placed {
            order: "o-1",
            total: 1250,
        })?
        .into(),
    };
    assert_eq!(to_hex(&env.encode()), to_hex(&documented));
    assert_eq!(documented.len(), 151, "the page says 151 bytes");
    assert_eq!(Envelope::decode(&documented)?, env);
    Ok(())
}

/// The gap notice in docs/wire-format.md is what the relay's writer produces, byte for byte.
#[test]
fn the_documented_gap_notice_is_exact() -> TestResult {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/wire-format.md"))?;
    let hex: String = doc
        .split_once("<!-- gap-hex: checked by tests/wire_interop.rs -->")
        .ok_or("gap marker missing from docs/wire-format.md")?
        .1
        .lines()
        .skip_while(|l| !l.starts_with("```"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .collect();
    let documented = from_hex(&hex)?;
    let mut notice = GapNotice::new("pump-17", 1_234_567_890_123_456_789, 43, 45, GapCause::Evicted);
    notice.created_ms = 1_767_225_600_999;
    assert_eq!(notice.id.to_string(), "db3ed0a8-6cc5-5d06-904c-0bb8051f7811");
    assert_eq!(to_hex(&notice.encode()), to_hex(&documented));
    assert_eq!(documented.len(), 94, "the page says 94 bytes");
    assert_eq!(Published::decode(&documented)?, Published::Gap(notice));
    Ok(())
}

/// Python (cbor2 and the standard library's zlib, nothing else) unpacks batches as a relay
/// publishes them through a real broker, plain and compressed: every message with its own id,
/// sequence number and key, in commit order.
#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn python_decodes_batches_the_relay_publishes() -> TestResult {
    use edge_outbox::{Batching, Compression, Relay};
    use support::device::{open_device, relay_config, wait_drained};
    use support::{Broker, Subscriber, WAIT};

    let broker = Broker::start()?;
    for compression in [Compression::None, Compression::Zlib] {
        let topic = format!("sensors/{compression:?}");
        let sub = Subscriber::start(broker.addr(), &topic)?;
        let dir = tempfile::tempdir()?;
        let outbox = open_device(dir.path());
        let ids = outbox
            .transaction(|tx| {
                (0..5u32)
                    .map(|i| tx.publish(&topic, &format!("k{}", i % 2), &(i, 21.5 + f64::from(i))))
                    .collect::<edge_outbox::Result<Vec<_>>>()
            })?
            .value;
        let config = relay_config(broker.addr(), "py-batch").batch(
            "sensors/#",
            Batching::new()
                .compression(compression)
                .linger(std::time::Duration::ZERO),
        );
        let relay = Relay::start(&outbox, config)?;
        assert!(sub.wait_for(1, WAIT), "{compression:?}: the batch arrives");
        assert!(wait_drained(&outbox, WAIT));
        relay.shutdown()?;
        let payloads = sub.payloads();
        assert_eq!(payloads.len(), 1, "{compression:?}: one publish");
        let out = run_script("tests/python/wire_decode.py", &[&to_hex(&payloads[0])])?;
        let lines: Vec<&str> = out.lines().collect();
        let how = if compression == Compression::Zlib {
            "zlib"
        } else {
            "plain"
        };
        assert_eq!(lines[0], format!("batch 5 {how}"));
        let blocks: Vec<&[&str]> = lines[1..].split(|l| *l == "--").skip(1).collect();
        assert_eq!(blocks.len(), 5);
        for (i, block) in blocks.iter().enumerate() {
            assert_eq!(block[0], "keys v,id,src,ep,seq,key,ts,p");
            assert_eq!(block[2], format!("id {}", to_hex(ids[i].as_bytes())));
            assert_eq!(block[5], format!("seq {}", i + 1));
            assert_eq!(block[6], format!("key k{}", i % 2));
            assert_eq!(block[10], format!("p [{i},{}]", 21.5 + i as f64));
        }
        sub.stop();
    }
    Ok(())
}
