//! A cloud-side consumer, with any MQTT client (rumqttc here): the consumer module checks that
//! nothing a device committed went missing on the way, and an inbox makes each effect happen once.
//!
//! - `Consumer` (edge_outbox::consumer) sees every item, batches unpacked
//!   (`Consumer::observe_all`): it recognises duplicates, follows each device's numbering, and
//!   reports gaps the devices announced (coalesced, evicted, expired, ...) and gaps nobody
//!   announced: messages lost after a device handed them to the broker.
//! - The inbox stores each event by message id, and its effect (here, a row per event, its payload
//!   as JSON, whatever its type) commits with the applied mark, so a redelivered event changes
//!   nothing, across restarts too.
//!
//! ```sh
//! cargo run --example cloud_consumer -- 127.0.0.1:1883 /tmp/cloud.db 'fleet/#'
//! # stop after 10 s without a message, exit code 1 if anything went missing unannounced:
//! cargo run --example cloud_consumer -- 127.0.0.1:1883 /tmp/cloud.db 'fleet/#' --exit-when-idle 10
//! ```
//!
//! Arguments: the broker (`HOST:PORT`), the consumer's own database file, the topic filter the
//! devices publish under (every topic they publish on: their numbering counts them all), and
//! optionally `--exit-when-idle SECS` and `--report-every SECS` (default 60).

use std::time::{Duration, Instant};

use edge_outbox::consumer::{Consumer, Verdict};
use edge_outbox::envelope::Published;
use edge_outbox::{Error, Outbox, Received};
use rumqttc::{Client, Event, MqttOptions, Packet, QoS};

/// Gaps still open this long count as unexplained: late messages and notices fill the rest.
const GRACE: Duration = Duration::from_secs(30);

struct Args {
    broker: String,
    db: String,
    filter: String,
    exit_when_idle: Option<Duration>,
    report_every: Duration,
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut positional = Vec::new();
    let mut exit_when_idle = None;
    let mut report_every = Duration::from_secs(60);
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut secs = |name: &str| -> Result<Duration, Box<dyn std::error::Error>> {
            let v = it.next().ok_or(format!("{name} needs a number of seconds"))?;
            Ok(Duration::from_secs_f64(v.parse()?))
        };
        match arg.as_str() {
            "--exit-when-idle" => exit_when_idle = Some(secs("--exit-when-idle")?),
            "--report-every" => report_every = secs("--report-every")?,
            _ => positional.push(arg),
        }
    }
    let mut positional = positional.into_iter();
    Ok(Args {
        broker: positional.next().unwrap_or_else(|| "127.0.0.1:1883".into()),
        db: positional.next().unwrap_or_else(|| "cloud-consumer.db".into()),
        filter: positional.next().unwrap_or_else(|| "#".into()),
        exit_when_idle,
        report_every,
    })
}

/// The effect of one event: a row with its payload as JSON, in the transaction that marks it
/// applied.
fn apply_stored(inbox: &Outbox) -> Result<(), Error> {
    while let edge_outbox::ApplyOutcome::Applied { .. } = inbox.apply_next(|tx, event| {
        let payload: serde_json::Value = event.payload_as()?;
        tx.execute(
            "INSERT INTO events (message_id, topic, key, payload) VALUES (?1, ?2, ?3, ?4)",
            (
                event.id.to_string(),
                &event.topic,
                &event.key,
                payload.to_string(),
            ),
        )?;
        Ok::<_, Error>(())
    })? {}
    Ok(())
}

/// Prints the report; whether anything went missing unannounced.
fn report(consumer: &Consumer, grace: Duration) -> bool {
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
    let (host, port) = args.broker.rsplit_once(':').ok_or("broker must be HOST:PORT")?;

    let inbox = Outbox::open(&args.db)?;
    inbox.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS events (message_id TEXT, topic TEXT, key TEXT, payload TEXT)",
        )
    })?;
    let mut consumer = Consumer::new();
    let mut last_report = Instant::now();
    let mut last_message = Instant::now();

    // A persistent session with manual acks: acknowledge only what is stored.
    let mut options = MqttOptions::new("cloud-consumer", host, port.parse()?);
    options
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_keep_alive(Duration::from_secs(30));
    let (client, mut connection) = Client::new(options, 64);
    loop {
        // Long enough for a connect to finish: rumqttc abandons a connect still in progress
        // when the timeout passes, and starts over at the next call.
        let event = connection.recv_timeout(Duration::from_secs(2));
        if let Some(idle) = args.exit_when_idle
            && last_message.elapsed() >= idle
        {
            // Everything has had its chance to arrive: what is still missing is lost.
            let lost = report(&consumer, Duration::ZERO);
            let _ = client.try_disconnect();
            std::process::exit(i32::from(lost));
        }
        match event {
            Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                client.try_subscribe(args.filter.as_str(), QoS::AtLeastOnce)?;
            }
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => println!("subscribed to {}", args.filter),
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                last_message = Instant::now();
                match consumer.observe_all(&p.payload) {
                    Ok(items) => {
                        for (item, verdict) in items {
                            match (item, verdict) {
                                (Published::Gap(gap), _) => println!(
                                    "{} removed {}..={} unpublished: {}",
                                    gap.source, gap.first, gap.last, gap.cause
                                ),
                                (_, Verdict::Duplicate) => {}
                                // One inbox row per event, batched or not.
                                (Published::Message(env), _) => {
                                    if let Received::DeadLettered { reason, .. } =
                                        inbox.receive(&p.topic, &env.encode())?
                                    {
                                        println!("malformed: {reason}");
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                    Err(e) => println!("not an edge-outbox envelope on {}: {e}", p.topic),
                }
                // Stored (or recognised) before it is acknowledged, from this thread, in order.
                client.try_ack(&p)?;
                // A real service might apply on another thread.
                apply_stored(&inbox)?;
                if last_report.elapsed() >= args.report_every {
                    last_report = Instant::now();
                    report(&consumer, GRACE);
                }
            }
            Ok(Ok(_)) | Err(_) => {}
            Ok(Err(e)) => {
                eprintln!("connection: {e}; retrying");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
}
