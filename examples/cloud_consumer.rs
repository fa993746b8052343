//! A cloud-side consumer, with any MQTT client (rumqttc here): the consumer module checks that
//! nothing a device committed went missing on the way, and its state commits with each effect, so
//! each effect happens once, across restarts too.
//!
//! - `DurableConsumer` (edge_outbox::consumer) sees every item, batches unpacked: it recognises
//!   duplicates, follows each device's numbering, and reports gaps the devices announced
//!   (coalesced, evicted, expired, ...) and gaps nobody announced: messages lost after a device
//!   handed them to the broker.
//! - Its state (the recent ids, the next number expected per device, the open gaps) lives in the
//!   consumer's own SQLite file, and the effect (here, a row per event, its payload as JSON,
//!   whatever its type) commits in the same transaction. Each MQTT payload is acknowledged after
//!   that commit: killed at any point, the consumer restarts where its last commit left it, the
//!   broker redelivers what it had not acknowledged, and that is neither repeated nor missed.
//!
//! ```sh
//! cargo run --example cloud_consumer -- 127.0.0.1:1883 /tmp/cloud.db 'fleet/#'
//! # stop after 10 s without a message, exit code 1 if anything went missing unannounced:
//! cargo run --example cloud_consumer -- 127.0.0.1:1883 /tmp/cloud.db 'fleet/#' --exit-when-idle 10
//! # one of two shards of a fleet whose devices publish under fleet/a/ and fleet/b/:
//! cargo run --example cloud_consumer -- 127.0.0.1:1883 /tmp/cloud-a.db 'fleet/a/#' --client-id cloud-a
//! ```
//!
//! Arguments: the broker (`HOST:PORT`, or the nodes of a cluster, `HOST:PORT,HOST:PORT,...`, tried
//! in turn when a connection fails), the consumer's own database file (one per consumer
//! process), the topic filter the devices publish under (every topic they publish on: their
//! numbering counts them all), and optionally `--client-id ID` (default `cloud-consumer`; one per
//! consumer process), `--from-start` (the consumer has been there since the devices' first
//! messages: a loss before the first one it sees counts too), `--exit-when-idle SECS` (exit after
//! that long subscribed without a message) and `--report-every SECS` (default 60).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use edge_outbox::Error;
use edge_outbox::consumer::{Consumer, DurableConsumer, Verdict};
use edge_outbox::envelope::Published;
use edge_outbox::rusqlite::Transaction;
use rumqttc::{Client, Event, MqttOptions, Packet, Publish, QoS};

/// Gaps still open this long count as unexplained: late messages and notices fill the rest.
const GRACE: Duration = Duration::from_secs(30);

struct Args {
    broker: String,
    db: String,
    filter: String,
    client_id: String,
    from_start: bool,
    exit_when_idle: Option<Duration>,
    report_every: Duration,
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut positional = Vec::new();
    let mut exit_when_idle = None;
    let mut report_every = Duration::from_secs(60);
    let mut client_id = "cloud-consumer".to_owned();
    let mut from_start = false;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--exit-when-idle" => {
                exit_when_idle = Some(Duration::from_secs_f64(value("--exit-when-idle")?.parse()?))
            }
            "--report-every" => report_every = Duration::from_secs_f64(value("--report-every")?.parse()?),
            "--client-id" => client_id = value("--client-id")?,
            "--from-start" => from_start = true,
            _ => positional.push(arg),
        }
    }
    let mut positional = positional.into_iter();
    Ok(Args {
        broker: positional.next().unwrap_or_else(|| "127.0.0.1:1883".into()),
        db: positional.next().unwrap_or_else(|| "cloud-consumer.db".into()),
        filter: positional.next().unwrap_or_else(|| "#".into()),
        client_id,
        from_start,
        exit_when_idle,
        report_every,
    })
}

/// The effect of one item, in the transaction that saves the consumer's verdict on it: a row per
/// event, its payload as JSON, when it was committed on the device and when it arrived. `Unknown` (a number the consumer cannot place) is stored too, and
/// the event's id, the table's key, has the last word.
fn apply(tx: &Transaction<'_>, topic: &str, item: &Published, verdict: Verdict) -> Result<(), Error> {
    match (item, verdict) {
        (Published::Gap(gap), _) => println!(
            "{} removed {}..={} unpublished: {}",
            gap.source, gap.first, gap.last, gap.cause
        ),
        (Published::Message(env), Verdict::New { .. } | Verdict::Unknown) => {
            let payload = match env.payload_as::<serde_json::Value>() {
                Ok(json) => json.to_string(),
                Err(e) => format!("{{\"undecodable\": {:?}}}", e.to_string()),
            };
            // A new message is stored once: a second row for its id is a bug, and fails loudly.
            // One the consumer cannot place may have been stored before: its id decides.
            let insert = if matches!(verdict, Verdict::Unknown) {
                "INSERT OR IGNORE"
            } else {
                "INSERT"
            };
            tx.execute(
                &format!(
                    "{insert} INTO events
                         (message_id, source, seq, topic, key, payload, created_ms, received_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
                ),
                (
                    env.id.to_string(),
                    env.source.as_ref(),
                    i64::try_from(env.seq).unwrap_or(i64::MAX),
                    topic,
                    env.key.as_ref(),
                    payload,
                    env.created_ms,
                    now_ms(),
                ),
            )?;
        }
        _ => {}
    }
    Ok(())
}

/// Milliseconds since the Unix epoch: when an event arrived, beside when it was committed.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Prints the report; whether anything went missing unannounced.
fn report(consumer: &DurableConsumer, grace: Duration) -> bool {
    let report = consumer.report_after(grace);
    print!("{report}");
    println!(
        "totals: {} delivered, {} duplicates, {} announced, {} unexplained",
        report.totals.delivered, report.totals.duplicates, report.totals.announced, report.totals.unexplained
    );
    if report.totals.unexplained > 0 {
        println!(
            "messages were lost after the devices handed them over: check the broker (docs/reliability.md)"
        );
    }
    report.totals.unexplained > 0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = args()?;
    let brokers = args
        .broker
        .split(',')
        .map(|b| {
            let (host, port) = b.rsplit_once(':').ok_or("broker must be HOST:PORT")?;
            Ok((host.to_owned(), port.parse::<u16>()?))
        })
        .collect::<Result<Vec<_>, Box<dyn std::error::Error>>>()?;

    let mut consumer = DurableConsumer::open(&args.db, Consumer::new().from_start(args.from_start))?;
    consumer.connection().execute_batch(
        "CREATE TABLE IF NOT EXISTS events (message_id TEXT PRIMARY KEY, source TEXT, seq INTEGER,
             topic TEXT, key TEXT, payload TEXT, created_ms INTEGER, received_ms INTEGER)",
    )?;
    let mut last_report = Instant::now();
    let mut last_message = Instant::now();
    let mut subscribed = false;

    // A persistent session with manual acks: acknowledge only what is committed.
    let connect = |(host, port): &(String, u16)| {
        let mut options = MqttOptions::new(args.client_id.as_str(), host.as_str(), *port);
        options
            .set_clean_session(false)
            .set_manual_acks(true)
            .set_keep_alive(Duration::from_secs(30));
        Client::new(options, 64)
    };
    let mut broker = 0;
    let (mut client, mut connection) = connect(&brokers[broker]);
    // Committed and not yet handed to the client: a burst of deliveries can fill its request
    // queue, which only drains as the connection is polled below.
    let mut unacked: VecDeque<Publish> = VecDeque::new();
    loop {
        while let Some(p) = unacked.front() {
            if client.try_ack(p).is_err() {
                break;
            }
            unacked.pop_front();
        }
        // Long enough for a connect to finish: rumqttc abandons a connect still in progress
        // when the timeout passes, and starts over at the next call.
        let event = connection.recv_timeout(Duration::from_secs(2));
        // Idle only while subscribed: a consumer waiting for its broker is not done.
        if let Some(idle) = args.exit_when_idle
            && subscribed
            && last_message.elapsed() >= idle
        {
            // Everything has had its chance to arrive: what is still missing is lost.
            let lost = report(&consumer, Duration::ZERO);
            let _ = client.try_disconnect();
            std::process::exit(i32::from(lost));
        }
        match event {
            Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                // A new connection: the broker delivers again what was not acknowledged, and an
                // ack of the old connection's packet id could acknowledge another message.
                unacked.clear();
                // Again on every connection: a broker that lost the session lost the subscription.
                client.try_subscribe(args.filter.as_str(), QoS::AtLeastOnce)?;
            }
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                println!("subscribed to {}", args.filter);
                subscribed = true;
                last_message = Instant::now();
            }
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                last_message = Instant::now();
                match consumer.observe_all(&p.payload, |tx, item, verdict| apply(tx, &p.topic, item, verdict))
                {
                    Ok(_) => {}
                    // Not ours: acknowledged, so that it is not delivered again forever.
                    Err(Error::Decode(e)) => println!("not an edge-outbox envelope on {}: {e}", p.topic),
                    // Nothing committed: stop unacknowledged; the broker delivers it again.
                    Err(e) => return Err(e.into()),
                }
                // Committed (or not ours) before it is acknowledged, from this thread, in order.
                unacked.push_back(p);
                if last_report.elapsed() >= args.report_every {
                    last_report = Instant::now();
                    report(&consumer, GRACE);
                }
            }
            Ok(Ok(_)) | Err(_) => {}
            Ok(Err(e)) => {
                // The next node of a cluster (the same broker again when there is one).
                subscribed = false;
                // Those acks belong to the old connection: its packet ids may name other
                // messages on the next one. The broker delivers them again.
                unacked.clear();
                broker = (broker + 1) % brokers.len();
                let (host, port) = &brokers[broker];
                eprintln!("connection: {e}; trying {host}:{port}");
                std::thread::sleep(Duration::from_millis(500));
                (client, connection) = connect(&brokers[broker]);
            }
        }
    }
}
