//! A cloud-side consumer, with any MQTT client (rumqttc here): the consumer module checks that
//! nothing a device committed went missing on the way, and an inbox makes each effect happen once.
//!
//! - `Consumer` (edge_outbox::consumer) sees every item: it recognises duplicates, follows each
//!   device's numbering, and reports gaps the devices announced (evicted, expired, ...) and gaps
//!   nobody announced: messages lost after a device handed them to the broker.
//! - The inbox stores each event by message id, and its effect (here, a row per reading) commits
//!   with the applied mark, so a redelivered event changes nothing, across restarts too.
//!
//! ```sh
//! cargo run --example cloud_consumer -- 127.0.0.1:1883 /tmp/cloud.db
//! ```

use std::time::{Duration, Instant};

use edge_outbox::consumer::{Consumer, Verdict};
use edge_outbox::envelope::Published;
use edge_outbox::{Error, Outbox, Received};
use rumqttc::{Client, Event, MqttOptions, Packet, QoS};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let broker = args.next().unwrap_or_else(|| "127.0.0.1:1883".into());
    let db = args.next().unwrap_or_else(|| "cloud-consumer.db".into());
    let (host, port) = broker.rsplit_once(':').ok_or("broker must be HOST:PORT")?;

    let inbox = Outbox::open(&db)?;
    inbox.with_connection(|c| {
        c.execute_batch("CREATE TABLE IF NOT EXISTS temperatures (message_id TEXT, probe TEXT, celsius REAL)")
    })?;
    // Gaps still open after 30 s count as unexplained: late messages and notices fill the rest.
    let mut consumer = Consumer::new();
    let mut last_report = Instant::now();

    // A persistent session with manual acks: acknowledge only what is stored.
    let mut options = MqttOptions::new("cloud-consumer", host, port.parse()?);
    options
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_keep_alive(Duration::from_secs(30));
    let (client, mut connection) = Client::new(options, 64);
    for event in connection.iter() {
        match event {
            // Every topic the devices publish on: their numbering counts them all.
            Ok(Event::Incoming(Packet::ConnAck(_))) => client.try_subscribe("sensors/#", QoS::AtLeastOnce)?,
            Ok(Event::Incoming(Packet::Publish(p))) => {
                match consumer.observe_bytes(&p.payload) {
                    Ok((Published::Gap(gap), _)) => println!(
                        "{} removed {}..={} unpublished: {}",
                        gap.source, gap.first, gap.last, gap.cause
                    ),
                    Ok((_, Verdict::Duplicate)) => {}
                    Ok(_) => match inbox.receive(&p.topic, &p.payload)? {
                        Received::Stored(id) => println!("stored {id}"),
                        Received::Duplicate(id) => println!("duplicate {id}: ignored"),
                        Received::DeadLettered { reason, .. } => println!("malformed: {reason}"),
                        _ => {}
                    },
                    Err(e) => println!("not an edge-outbox envelope on {}: {e}", p.topic),
                }
                // Stored (or recognised) before it is acknowledged, from this thread, in order.
                client.try_ack(&p)?;
                // Apply what is stored. A real service might do this on another thread.
                while let edge_outbox::ApplyOutcome::Applied { .. } = inbox.apply_next(|tx, cmd| {
                    let celsius: f64 = cmd.payload_as()?;
                    tx.execute(
                        "INSERT INTO temperatures VALUES (?1, ?2, ?3)",
                        (cmd.id.to_string(), &cmd.key, celsius),
                    )?;
                    Ok::<_, Error>(())
                })? {}
                if last_report.elapsed() >= Duration::from_secs(60) {
                    last_report = Instant::now();
                    let report = consumer.report_after(Duration::from_secs(30));
                    print!("{report}");
                    if report.totals.unexplained > 0 {
                        println!(
                            "messages were lost after the devices handed them over: check the broker (docs/reliability.md)"
                        );
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!("connection: {e}; retrying");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
    Ok(())
}
