//! Payload schemas (feature `schemas`): a payload is checked against its topic's CDDL where it is
//! written, so an invalid event fails the business transaction; a row some other writer committed
//! is checked by the relay and dead-lettered (announced to the cloud) instead of published; a new
//! version may only add optional fields.
#![cfg(feature = "schemas")]

mod common;
mod support;

use std::path::Path;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::envelope::{Envelope, Published};
use edge_outbox::{Error, EventSchema, Message, Options, Outbox, Relay};
use serde::Serialize;
use support::device::relay_config_for;
use support::python::run_script;
use support::{Broker, Subscriber, WAIT, wait_until};

const ORDER_V1: &str =
    "order = { id: tstr, total: uint, ? items: [* item] }\nitem = { sku: tstr, qty: uint }";

fn order_v1() -> EventSchema {
    EventSchema::new("order.placed", 1, "orders/#", ORDER_V1)
}

fn open(path: &Path, schemas: &[EventSchema]) -> edge_outbox::Result<Outbox> {
    let options = schemas.iter().cloned().fold(Options::new(), Options::schema);
    let outbox = Outbox::open_with(path, options)?;
    outbox.with_connection(|c| c.execute_batch("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)"))?;
    Ok(outbox)
}

#[derive(Serialize)]
struct Order<'a> {
    id: &'a str,
    total: i64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    items: Vec<Item<'a>>,
}

#[derive(Serialize)]
struct Item<'a> {
    sku: &'a str,
    qty: i64,
}

/// Writes the business row and publishes `order` in one transaction.
fn place(outbox: &Outbox, order: &Order<'_>) -> edge_outbox::Result<()> {
    outbox
        .transaction(|tx| {
            tx.execute("INSERT INTO orders (id) VALUES (?1)", [order.id])?;
            tx.publish("orders/placed", order.id, order)?;
            Ok(())
        })
        .map(|_| ())
}

/// The path and reason of a schema violation, or why the result is not one.
fn violation(result: edge_outbox::Result<()>) -> Result<(String, String), String> {
    match result {
        Err(Error::SchemaViolation(m)) => {
            assert_eq!(m.topic, "orders/placed");
            assert_eq!(m.schema, "order.placed v1");
            assert_eq!(m.rule, "order");
            Ok((m.path, m.reason))
        }
        other => Err(format!("expected a schema violation, got {other:?}")),
    }
}

#[test]
fn an_invalid_payload_fails_its_transaction_and_names_the_field() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, &[order_v1()])?;

    let negative = Order {
        id: "o-1",
        total: -5,
        items: vec![],
    };
    let (at, reason) = violation(place(&outbox, &negative))?;
    assert_eq!(at, "$.total", "{reason}");
    assert!(reason.contains("uint"), "{reason}");

    let bad_item = Order {
        id: "o-2",
        total: 5,
        items: vec![Item { sku: "a", qty: 1 }, Item { sku: "b", qty: -1 }],
    };
    assert_eq!(violation(place(&outbox, &bad_item))?.0, "$.items[1].qty");

    let missing = outbox
        .transaction(|tx| {
            tx.execute("INSERT INTO orders (id) VALUES ('o-3')", [])?;
            tx.publish(
                "orders/placed",
                "o-3",
                &std::collections::BTreeMap::from([("id", "o-3")]),
            )?;
            Ok(())
        })
        .map(|_| ());
    assert_eq!(violation(missing)?, ("$.total".to_owned(), "missing".to_owned()));

    // Nothing of the failed transactions is committed: no business row, no message.
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM orders")?, 0);
    assert_eq!(outbox.stats()?.pending_messages, 0);

    // A valid one commits, stamped with its schema's event type and version.
    place(
        &outbox,
        &Order {
            id: "o-4",
            total: 5,
            items: vec![Item { sku: "a", qty: 2 }],
        },
    )?;
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM orders")?, 1);
    let event_type: String =
        outbox.with_connection(|c| c.query_row("SELECT event_type FROM outbox", [], |r| r.get(0)))?;
    assert_eq!(event_type, "order.placed");
    let headers: Vec<u8> =
        outbox.with_connection(|c| c.query_row("SELECT headers FROM outbox", [], |r| r.get(0)))?;
    let headers: std::collections::BTreeMap<String, String> = ciborium::from_reader(headers.as_slice())?;
    assert_eq!(headers.get("schema-version").map(String::as_str), Some("1"));

    // Topics no schema covers pass, unless schemas are strict.
    outbox.transaction(|tx| tx.publish("telemetry/t1", "t1", &21.5))?;
    drop(outbox);
    let strict = Outbox::open_with(&path, Options::new().strict_schemas(true))?;
    let refused = strict.transaction(|tx| tx.publish("telemetry/t1", "t1", &21.5));
    assert!(
        matches!(&refused, Err(Error::SchemaViolation(m)) if m.reason.contains("strict")),
        "{refused:?}"
    );
    Ok(())
}

#[test]
fn a_handle_opened_without_the_schemas_still_checks_with_the_files() -> TestResult {
    let (_dir, path) = temp_db()?;
    drop(open(&path, &[order_v1()])?);
    let plain = open(&path, &[])?;
    let (at, _) = violation(place(
        &plain,
        &Order {
            id: "o-1",
            total: -1,
            items: vec![],
        },
    ))?;
    assert_eq!(at, "$.total");
    assert_eq!(query_i64(&plain, "SELECT count(*) FROM orders")?, 0);
    Ok(())
}

/// What opening with `v1` and then `next` does to the file's schemas.
fn register_after_v1(next: EventSchema) -> edge_outbox::Result<Outbox> {
    let (dir, path) = temp_db().map_err(|e| Error::InvalidConfig(e.to_string()))?;
    drop(open(&path, &[order_v1()])?);
    let opened = open(&path, &[order_v1(), next]);
    drop(dir);
    opened
}

fn refusal(next: &str) -> String {
    match register_after_v1(EventSchema::new("order.placed", 2, "orders/#", next)) {
        Err(Error::InvalidConfig(why)) => why,
        other => format!("not refused: {other:?}"),
    }
}

#[test]
fn an_incompatible_new_version_is_refused_and_a_compatible_one_accepted() -> TestResult {
    let item = "item = { sku: tstr, qty: uint }";
    let required = refusal(&format!(
        "order = {{ id: tstr, total: uint, ? items: [* item], currency: tstr }}\n{item}"
    ));
    assert!(
        required.contains("new field \"currency\" is required"),
        "{required}"
    );
    let removed = refusal(&format!("order = {{ id: tstr, ? items: [* item] }}\n{item}"));
    assert!(removed.contains("field \"total\" was removed"), "{removed}");
    let retyped = refusal(&format!(
        "order = {{ id: tstr, total: tstr, ? items: [* item] }}\n{item}"
    ));
    assert!(retyped.contains("field \"total\" changed"), "{retyped}");
    let unparsable = refusal("order = { id: ");
    assert!(unparsable.contains("not valid CDDL"), "{unparsable}");

    // A registered version never changes.
    let (_dir, path) = temp_db()?;
    drop(open(&path, &[order_v1()])?);
    let changed = Outbox::open_with(
        &path,
        Options::new().schema(EventSchema::new(
            "order.placed",
            1,
            "orders/#",
            "order = { id: tstr }",
        )),
    );
    assert!(
        matches!(&changed, Err(Error::InvalidConfig(why)) if why.contains("version never changes")),
        "{changed:?}"
    );

    // Adding an optional field is compatible; both versions are published side by side.
    let v2 = EventSchema::new(
        "order.placed",
        2,
        "orders/#",
        format!("order = {{ id: tstr, total: uint, ? items: [* item], ? currency: tstr }}\n{item}"),
    );
    let outbox = open(&path, &[order_v1(), v2])?;
    let with_currency = |version: &str| {
        Message::new(
            "orders/placed",
            "o-9",
            &std::collections::BTreeMap::from([
                ("id", ciborium::Value::from("o-9")),
                ("total", ciborium::Value::from(3)),
                ("currency", ciborium::Value::from("EUR")),
            ]),
        )
        .map(|m| m.event_type("order.placed").header("schema-version", version))
    };
    // Unnamed, the newest version applies.
    outbox.transaction(|tx| {
        tx.publish(
            "orders/placed",
            "o-8",
            &Order {
                id: "o-8",
                total: 1,
                items: vec![],
            },
        )
    })?;
    outbox.transaction(|tx| tx.send(&with_currency("2")?))?;
    let old = outbox.transaction(|tx| tx.send(&with_currency("1")?));
    assert!(
        matches!(&old, Err(Error::SchemaViolation(m)) if m.schema == "order.placed v1"),
        "v1 has no currency: {old:?}"
    );
    let unknown = outbox.transaction(|tx| tx.send(&with_currency("7")?));
    assert!(
        matches!(&unknown, Err(Error::SchemaViolation(m)) if m.reason.contains("no registered version 7")),
        "a version never registered is refused: {unknown:?}"
    );
    let versions: Vec<String> = outbox.with_connection(|c| {
        c.prepare("SELECT headers FROM outbox ORDER BY seq")?
            .query_map([], |r| r.get::<_, Vec<u8>>(0))?
            .map(|h| {
                let h = h?;
                let map: std::collections::BTreeMap<String, String> =
                    ciborium::from_reader(h.as_slice()).unwrap_or_default();
                Ok(map.get("schema-version").cloned().unwrap_or_default())
            })
            .collect::<rusqlite::Result<Vec<_>>>()
    })?;
    assert_eq!(versions, ["2", "2"]);
    Ok(())
}

/// The broken builds the scenario below catches: no check where rows are written by another
/// process (the relay publishes them), and none in `Tx::publish`.
#[test]
fn an_invalid_row_from_pythons_sqlite3_is_dead_lettered_and_announced() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, &[order_v1()])?;
    run_script(
        "tests/python/schema_foreign_writer.py",
        &[path.to_str().ok_or("path")?],
    )?;
    place(
        &outbox,
        &Order {
            id: "o-rust",
            total: 3,
            items: vec![],
        },
    )?;

    let config = relay_config_for(&broker, "schemas-device").publish_schemas("contracts/schemas-device");
    let relay = Relay::start(&outbox, config)?;
    let settled = wait_until(|| {
        outbox
            .stats()
            .is_ok_and(|s| s.pending_messages == 0 && s.gaps_unannounced == 0)
    });
    assert!(settled, "the relay settled the outbox");
    assert!(sub.wait_for(3, WAIT), "two orders and one gap notice arrive");
    // The contract, retained: a consumer joining later fetches it.
    let contract = Subscriber::start(broker.addr(), "contracts/#")?;
    assert!(contract.wait_for(1, WAIT), "the schemas are published, retained");
    relay.shutdown()?;
    let published = EventSchema::decode_published(&contract.messages()[0].payload)?;
    assert_eq!(published, [order_v1()]);

    let dead = outbox.dead_letters(10)?;
    assert_eq!(dead.len(), 1, "one row dead-lettered: {dead:?}");
    assert_eq!(dead[0].key, "o-py-2");
    assert!(
        dead[0].reason.contains("schema order.placed v1") && dead[0].reason.contains("at $.id"),
        "its reason names the schema and the field: {}",
        dead[0].reason
    );
    let mut consumer = Consumer::new().from_start(true).schemas(&published)?;
    for m in sub.messages() {
        consumer.observe_bytes(&m.payload)?;
    }
    let report = consumer.report();
    assert_eq!(report.totals.delivered, 2, "{report}");
    assert_eq!(report.totals.unexplained, 0, "{report}");
    assert_eq!(
        report.streams[0].announced_by_cause.get("dead-lettered").copied(),
        Some(1),
        "the invalid row is announced: {report}"
    );
    assert_eq!(
        report.totals.schema_violations, 0,
        "nothing invalid was published: {report}"
    );
    Ok(())
}

#[cfg(feature = "mutants")]
#[test]
fn the_schema_mutants_are_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "schema-unchecked-at-relay",
        "an_invalid_row_from_pythons_sqlite3_is_dead_lettered_and_announced",
        "one row dead-lettered",
    )?;
    support::mutant::caught_by(
        "schema-unchecked-at-write",
        "an_invalid_payload_fails_its_transaction_and_names_the_field",
        "expected a schema violation",
    )?;
    support::mutant::caught_by(
        "schemas-read-once",
        "a_running_relay_checks_with_versions_registered_after_it_started",
        "no message dead-lettered",
    )?;
    support::mutant::caught_by(
        "consumer-schema-unchecked",
        "the_consumer_flags_a_delivered_payload_that_breaks_its_schema",
        "one schema violation counted",
    )?;
    Ok(())
}

/// A message as a relay would publish it: `seq` of one source, typed when `version` is given.
fn envelope(seq: u64, version: Option<&str>, payload: &impl Serialize) -> TestResult<Envelope<'static>> {
    Ok(Envelope {
        id: edge_outbox::MessageId::new_v7(),
        source: "device-1".into(),
        epoch: 1,
        seq,
        key: "k".into(),
        created_ms: 0,
        event_type: version.map(|_| "order.placed".into()),
        headers: version
            .map(|v| vec![("schema-version".into(), v.to_owned().into())])
            .unwrap_or_default(),
        payload: edge_outbox::envelope::to_cbor(payload)?.into(),
    })
}

#[test]
fn the_consumer_flags_a_delivered_payload_that_breaks_its_schema() -> TestResult {
    let envelopes = [
        envelope(
            1,
            Some("1"),
            &Order {
                id: "o-1",
                total: 1,
                items: vec![],
            },
        )?,
        envelope(
            2,
            Some("1"),
            &Order {
                id: "o-2",
                total: -1,
                items: vec![],
            },
        )?,
        // No event type: no contract named, nothing to check.
        envelope(3, None, &"free text")?,
    ];
    let mut consumer = Consumer::new().from_start(true).schemas(&[order_v1()])?;
    for env in &envelopes {
        consumer.observe(&Published::Message(env.clone()));
        // A duplicate is not counted again.
        consumer.observe(&Published::Message(env.clone()));
    }
    let report = consumer.report();
    assert_eq!(report.totals.delivered, 3, "{report}");
    assert_eq!(
        report.totals.schema_violations, 1,
        "one schema violation counted: {report}"
    );
    let finding = &report.schema_findings[0];
    assert_eq!(finding.seq, 2);
    assert!(finding.reason.contains("at $.total"), "{}", finding.reason);
    assert!(consumer.check_schema(&envelopes[1]).is_err());
    assert!(consumer.check_schema(&envelopes[0]).is_ok());
    // An incompatible pair of versions is refused here as on the device.
    let v2 = EventSchema::new("order.placed", 2, "orders/#", "order = { id: tstr }");
    let refused = Consumer::new().schemas(&[order_v1(), v2]);
    assert!(matches!(&refused, Err(Error::InvalidConfig(why)) if why.contains("removed")));
    Ok(())
}

/// `edge-outbox ARGS --db PATH`: exit code and stdout.
#[cfg(feature = "cli")]
fn cli(path: &Path, args: &[&str]) -> TestResult<(Option<i32>, String)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(args)
        .arg("--db")
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()?;
    let stdout = String::from_utf8(out.stdout)?;
    eprintln!("{args:?}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    Ok((out.status.code(), stdout))
}

#[cfg(feature = "cli")]
#[test]
fn schema_check_exits_non_zero_on_a_bad_pending_row() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, &[order_v1()])?;
    place(
        &outbox,
        &Order {
            id: "o-1",
            total: 3,
            items: vec![],
        },
    )?;

    let (code, listed) = cli(&path, &["schema", "list"])?;
    assert_eq!(code, Some(0));
    assert!(
        listed.contains("order.placed") && listed.contains("orders/#"),
        "{listed}"
    );
    let (code, shown) = cli(&path, &["schema", "show", "order.placed"])?;
    assert_eq!((code, shown.trim_end()), (Some(0), ORDER_V1));
    assert_eq!(cli(&path, &["schema", "show", "order.cancelled"])?.0, Some(5));
    assert_eq!(
        cli(&path, &["schema", "check"])?.0,
        Some(0),
        "every pending row matches"
    );

    // A foreign writer's row that breaks the schema (its id is a number).
    let bad = edge_outbox::envelope::to_cbor(&std::collections::BTreeMap::from([("id", 2), ("total", 1)]))?;
    outbox.with_connection(|c| {
        c.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES ('orders/placed', 'o-2', ?1)",
            [bad],
        )
    })?;
    let (code, found) = cli(&path, &["schema", "check"])?;
    assert_eq!(code, Some(7), "a bad row is reported: {found}");
    assert!(
        found.contains("#2 orders/placed") && found.contains("at $.id"),
        "{found}"
    );

    let payload = |json: &str| {
        cli(
            &path,
            &["schema", "check", "--topic", "orders/placed", "--payload", json],
        )
    };
    assert_eq!(payload(r#"{"id": "o-3", "total": 1}"#)?.0, Some(0));
    assert_eq!(payload(r#"{"id": "o-3"}"#)?.0, Some(7));
    assert_eq!(payload("not json")?.0, Some(2));
    Ok(())
}

#[test]
fn a_schema_nested_too_deep_is_refused_not_a_crash_from_any_source() -> TestResult {
    let deep = format!("a = {}uint{}", "[".repeat(5000), "]".repeat(5000));
    let (_dir, path) = temp_db()?;
    let refused = Outbox::open_with(
        &path,
        Options::new().schema(EventSchema::new("deep", 1, "d/#", &deep)),
    );
    assert!(
        matches!(&refused, Err(Error::InvalidConfig(why)) if why.contains("levels deep")),
        "{refused:?}"
    );
    // Written into the table by SQL: every open refuses the file's schemas instead of aborting.
    let outbox = open(&path, &[])?;
    outbox.with_connection(|c| {
        c.execute(
            "INSERT INTO edge_outbox_schemas (event_type, version, topic_filter, cddl) VALUES ('deep', 1, 'd/#', ?1)",
            [&deep],
        )
    })?;
    drop(outbox);
    assert!(matches!(Outbox::open(&path), Err(Error::InvalidConfig(_))));
    // Published as the contract: the consumer refuses it.
    let list = EventSchema::decode_published(&edge_outbox::envelope::to_cbor(&[
        std::collections::BTreeMap::from([
            ("type", ciborium::Value::from("deep")),
            ("version", ciborium::Value::from(1)),
            ("topics", ciborium::Value::from("d/#")),
            ("cddl", ciborium::Value::from(deep.as_str())),
        ]),
    ])?)?;
    assert!(Consumer::new().schemas(&list).is_err());
    Ok(())
}

#[test]
fn a_change_inside_a_named_rule_or_out_of_order_is_refused_too() -> TestResult {
    // The field's type is a rule of its own: its change is a change of the field.
    let v1 = EventSchema::new("reading", 1, "r/#", "reading = { value: amount }\namount = uint");
    let retyped = EventSchema::new("reading", 2, "r/#", "reading = { value: amount }\namount = tstr");
    let (_d1, p1) = temp_db()?;
    let refused = open(&p1, &[v1.clone(), retyped]);
    assert!(
        matches!(&refused, Err(Error::InvalidConfig(why)) if why.contains("field \"value\" changed")),
        "{refused:?}"
    );
    // A v2 given before its v1, on a new file: checked all the same.
    let v2_without = EventSchema::new("reading", 2, "r/#", "reading = { ? note: tstr }");
    let (_d2, p2) = temp_db()?;
    let refused = open(&p2, &[v2_without.clone(), v1.clone()]);
    assert!(
        matches!(&refused, Err(Error::InvalidConfig(why)) if why.contains("removed")),
        "{refused:?}"
    );
    assert_eq!(
        Outbox::open(&p2)?.with_connection(|c| {
            c.query_row("SELECT count(*) FROM edge_outbox_schemas", [], |r| {
                r.get::<_, i64>(0)
            })
        })?,
        0,
        "nothing of a refused open is registered"
    );
    Ok(())
}

#[test]
fn a_writer_cannot_step_around_its_topics_schema() -> TestResult {
    let (_dir, path) = temp_db()?;
    let anything = EventSchema::new("debug.any", 1, "debug/#", "any-value = any");
    let outbox = open(&path, &[order_v1(), anything])?;
    let bad = Order {
        id: "o-1",
        total: -1,
        items: vec![],
    };
    // Naming a type registered for another topic, or none at all, is not a way out.
    for event_type in ["debug.any", "order.cancelled"] {
        let named = outbox
            .transaction(|tx| tx.send(&Message::new("orders/placed", "o-1", &bad)?.event_type(event_type)));
        assert!(
            matches!(&named, Err(Error::SchemaViolation(m)) if m.reason.contains("not registered for topic")),
            "{event_type}: {named:?}"
        );
    }
    // A map key given twice is refused: the validator would see only its last value.
    let twice = Message::from_cbor(
        "orders/placed",
        "o-1",
        vec![
            0xa3, 0x62, b'i', b'd', 0x61, b'o', 0x65, b't', b'o', b't', b'a', b'l', 0x20, 0x65, b't', b'o',
            b't', b'a', b'l', 0x01,
        ],
    )?;
    let repeated = outbox.transaction(|tx| tx.send(&twice));
    assert!(
        matches!(&repeated, Err(Error::SchemaViolation(m)) if m.reason.contains("\"total\" is repeated")),
        "{repeated:?}"
    );
    assert_eq!(outbox.stats()?.pending_messages, 0);
    Ok(())
}

#[test]
fn a_running_relay_checks_with_versions_registered_after_it_started() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let (_dir, path) = temp_db()?;
    let device = open(&path, &[order_v1()])?;
    let relay = Relay::start(&device, relay_config_for(&broker, "schemas-later"))?;
    place(
        &device,
        &Order {
            id: "o-1",
            total: 1,
            items: vec![],
        },
    )?;
    assert!(sub.wait_for(1, WAIT), "the first order is published");
    // Another process registers v2 and writes a v2 order.
    let v2 = EventSchema::new(
        "order.placed",
        2,
        "orders/#",
        "order = { id: tstr, total: uint, ? items: [* item], ? currency: tstr }\nitem = { sku: tstr, qty: uint }",
    );
    let writer = open(&path, &[order_v1(), v2])?;
    writer.transaction(|tx| {
        tx.publish(
            "orders/placed",
            "o-2",
            &std::collections::BTreeMap::from([
                ("id", ciborium::Value::from("o-2")),
                ("total", ciborium::Value::from(2)),
                ("currency", ciborium::Value::from("EUR")),
            ]),
        )
    })?;
    assert!(
        sub.wait_for(2, WAIT),
        "the v2 order is published, not dead-lettered"
    );
    relay.shutdown()?;
    let dead = device.dead_letters(10)?;
    assert!(dead.is_empty(), "no message dead-lettered: {dead:?}");
    Ok(())
}
