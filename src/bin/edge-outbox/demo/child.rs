//! The demo's child processes: a device playing one role of the first article, and a consumer
//! that charges for each order it receives, with or without an inbox. Both are this binary,
//! started as `edge-outbox demo-child ...`, so their crashes are real process deaths.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use edge_outbox::{Envelope, MessageId, MqttConfig, Outbox, Protocol, Received, Relay, RelayConfig};
use rumqttc::{Client, Event, MqttOptions, Packet, QoS};

use crate::Result;
use crate::exit::CliError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    /// Commit the order, then crash before publishing (dual write, database first).
    CommitThenCrash,
    /// Publish the event, then crash before committing (dual write, broker first).
    PublishThenCrash,
    /// Commit order and outbox row together; crash after the broker's PUBACK, before the mark.
    OutboxCrashAfterPublish,
    /// Restart after the crash: the relay publishes what is still unmarked.
    OutboxResume,
    /// Receive orders and charge for each one.
    Consumer,
    /// Receive orders through an inbox and charge for each distinct one.
    DedupingConsumer,
}

#[derive(Debug, Clone, Args)]
pub struct ChildArgs {
    #[arg(long, value_enum)]
    pub role: Role,
    #[arg(long)]
    pub broker: String,
    #[arg(long)]
    pub db: PathBuf,
    /// Topic prefix of this scenario.
    #[arg(long)]
    pub prefix: String,
}

pub fn run(args: &ChildArgs) -> Result<()> {
    match args.role {
        Role::CommitThenCrash => commit_then_crash(args),
        Role::PublishThenCrash => publish_then_crash(args),
        Role::OutboxCrashAfterPublish => outbox_crash_after_publish(args),
        Role::OutboxResume => outbox_resume(args),
        Role::Consumer | Role::DedupingConsumer => consume(args, args.role == Role::DedupingConsumer),
    }
}

const ORDER: (&str, i64) = ("o-1", 40);

fn order_envelope() -> Vec<u8> {
    Envelope {
        id: MessageId::new_v7(),
        source: "demo-device".into(),
        epoch: 0,
        seq: 1,
        key: ORDER.0.into(),
        created_ms: 0,
        event_type: Some("OrderPlaced".into()),
        headers: vec![],
        payload: edge_outbox::envelope::to_cbor(&ORDER).unwrap_or_default().into(),
    }
    .encode()
}

fn orders_table(conn: &rusqlite::Connection) -> Result<()> {
    conn.execute_batch("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, total INTEGER NOT NULL)")?;
    Ok(())
}

/// The crash: an abort, no destructors, no flushes.
fn crash(why: &str) -> ! {
    eprintln!("demo device: crash {why}");
    std::process::abort()
}

fn commit_then_crash(args: &ChildArgs) -> Result<()> {
    let conn = rusqlite::Connection::open(&args.db)?;
    orders_table(&conn)?;
    conn.execute("INSERT INTO orders VALUES (?1, ?2)", ORDER)?;
    crash("after the commit, before the publish")
}

fn publish_then_crash(args: &ChildArgs) -> Result<()> {
    let conn = rusqlite::Connection::open(&args.db)?;
    orders_table(&conn)?;
    let (host, port) = split(&args.broker)?;
    let mut options = MqttOptions::new("demo-dual-writer", host, port);
    options.set_keep_alive(Duration::from_secs(5));
    let (client, mut connection) = Client::new(options, 8);
    client
        .try_publish(
            format!("{}/orders", args.prefix),
            QoS::AtLeastOnce,
            false,
            order_envelope(),
        )
        .map_err(|e| CliError::runtime(format!("publish: {e}")))?;
    for event in connection.iter() {
        match event {
            Ok(Event::Incoming(Packet::PubAck(_))) => crash("after the publish, before the commit"),
            Ok(_) => {}
            Err(e) => return Err(CliError::runtime(format!("broker: {e}"))),
        }
    }
    Err(CliError::runtime("connection closed before the PUBACK"))
}

fn relay_config(args: &ChildArgs) -> Result<RelayConfig> {
    let (host, port) = split(&args.broker)?;
    // The demo's in-process rumqttd listens for MQTT 3.1.1 only (its MQTT 5 listener is a
    // separate port), and the demo is about deduplication, not broker refusals.
    Ok(RelayConfig::new(
        MqttConfig::new(host, port)
            .client_id("demo-device")
            .protocol(Protocol::V311),
    ))
}

fn outbox_crash_after_publish(args: &ChildArgs) -> Result<()> {
    let outbox = Outbox::open(&args.db)?;
    outbox.with_connection(orders_table)?;
    outbox.transaction(|tx| {
        tx.execute("INSERT INTO orders VALUES (?1, ?2)", ORDER)?;
        tx.publish(&format!("{}/orders", args.prefix), ORDER.0, &ORDER)?;
        Ok::<_, edge_outbox::Error>(())
    })?;
    // Hold the write lock so the relay's mark waits: the crash lands after the PUBACK and
    // before the row is marked, the window that makes the relay publish twice.
    let blocker = rusqlite::Connection::open(&args.db)?;
    blocker.execute_batch("BEGIN IMMEDIATE")?;
    let relay = Relay::start(&outbox, relay_config(args)?)?;
    wait(|| Ok(relay.status()?.acknowledged >= 1))?;
    crash("after the PUBACK, before the mark")
}

fn outbox_resume(args: &ChildArgs) -> Result<()> {
    let outbox = Outbox::open(&args.db)?;
    let relay = Relay::start(&outbox, relay_config(args)?)?;
    wait(|| Ok(relay.status()?.store.pending_messages == 0))?;
    relay.shutdown()?;
    Ok(())
}

fn wait(mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done()? {
        if Instant::now() > deadline {
            return Err(CliError::runtime("timed out waiting for the broker"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Charges for each order received. With `dedupe`, through an inbox: the charge commits with
/// the applied mark, so a second copy of the same message is recognised and charges nothing.
fn consume(args: &ChildArgs, dedupe: bool) -> Result<()> {
    let store = Outbox::open(&args.db)?;
    store.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS deliveries (payload BLOB NOT NULL);
             CREATE TABLE IF NOT EXISTS charges (order_id TEXT NOT NULL, amount INTEGER NOT NULL);",
        )
    })?;
    let (host, port) = split(&args.broker)?;
    let mut options = MqttOptions::new(format!("{}-consumer", args.prefix.replace('/', "-")), host, port);
    // Connected before any device runs, so a clean session misses nothing; acks only after the
    // delivery and its charge are stored.
    options
        .set_manual_acks(true)
        .set_keep_alive(Duration::from_secs(5));
    let (client, mut connection) = Client::new(options, 64);
    for event in connection.iter() {
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                let _ = client.try_subscribe(format!("{}/#", args.prefix), QoS::AtLeastOnce);
            }
            Ok(Event::Incoming(Packet::SubAck(_))) => println!("ready"),
            Ok(Event::Incoming(Packet::Publish(p))) => {
                store.with_connection(|c| {
                    c.execute("INSERT INTO deliveries VALUES (?1)", [p.payload.as_ref()])
                })?;
                if dedupe {
                    if let Received::Stored(_) = store.receive(&p.topic, &p.payload)? {
                        store.apply_next(|tx, cmd| {
                            let (order, amount): (String, i64) = cmd.payload_as()?;
                            tx.execute("INSERT INTO charges VALUES (?1, ?2)", (order, amount))?;
                            Ok::<_, edge_outbox::Error>(())
                        })?;
                    }
                } else {
                    let env = Envelope::decode(&p.payload)?;
                    let (order, amount): (String, i64) = env.payload_as()?;
                    store.with_connection(|c| {
                        c.execute("INSERT INTO charges VALUES (?1, ?2)", (order, amount))
                    })?;
                }
                let _ = client.try_ack(&p);
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!("demo consumer: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    Ok(())
}

pub fn split(addr: &str) -> Result<(String, u16)> {
    addr.rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_owned(), p.parse().ok()?)))
        .ok_or_else(|| CliError::usage(format!("bad broker address {addr:?}")))
}
