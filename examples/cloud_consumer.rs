//! A cloud-side consumer that deduplicates with its own inbox: each event is stored by message
//! id, and its effect (here, a row per reading) commits with the applied mark, so a redelivered
//! event changes nothing.
//!
//! ```sh
//! cargo run --example cloud_consumer -- 127.0.0.1:1883 /tmp/cloud.db
//! ```

use std::time::Duration;

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

    // A persistent session with manual acks: acknowledge only what is stored.
    let mut options = MqttOptions::new("cloud-consumer", host, port.parse()?);
    options
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_keep_alive(Duration::from_secs(30));
    let (client, mut connection) = Client::new(options, 64);
    for event in connection.iter() {
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => client.try_subscribe("sensors/#", QoS::AtLeastOnce)?,
            Ok(Event::Incoming(Packet::Publish(p))) => {
                match inbox.receive(&p.topic, &p.payload)? {
                    Received::Stored(id) => println!("stored {id}"),
                    Received::Duplicate(id) => println!("duplicate {id}: ignored"),
                    Received::DeadLettered { reason, .. } => println!("malformed: {reason}"),
                    _ => {}
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
