//! A field device: sensor readings are business rows, each announced by an outbox event in the
//! same transaction; commands from the cloud change the sampling interval through the inbox.
//!
//! ```sh
//! mosquitto -p 1883 &                      # or any broker
//! cargo run --example field_device -- 127.0.0.1:1883 /tmp/device.db
//! mosquitto_sub -t 'sensors/#' -v          # watch the events (CBOR envelopes)
//! edge-outbox send-command --broker mqtt://127.0.0.1:1883 --topic devices/pump-17/commands/interval \
//!     --key pump-17 --payload 500            # sample every 500 ms
//! ```
//! Stop it with Ctrl-C (or SIGTERM): the relay stops cleanly, and what was committed and not yet
//! acknowledged is published next time.
//!
//! Copied into a project of its own, it needs, beside `edge-outbox`:
//!
//! ```toml
//! tracing-subscriber = { version = "0.3", features = ["env-filter"] }
//! signal-hook = "0.3"
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use edge_outbox::{Error, Message, MqttConfig, Outbox, Relay, RelayConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter("edge_outbox=info")
        .init();
    let mut args = std::env::args().skip(1);
    let broker = args.next().unwrap_or_else(|| "127.0.0.1:1883".into());
    let db = args.next().unwrap_or_else(|| "field-device.db".into());
    let (host, port) = broker.rsplit_once(':').ok_or("broker must be HOST:PORT")?;

    // Ctrl-C and SIGTERM only raise a flag; the loop below sees it and shuts the relay down.
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop))?;
    }

    let outbox = Outbox::open(&db)?;
    outbox.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS readings (at_ms INTEGER, probe TEXT, celsius REAL);
             CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY, value INTEGER);
             INSERT OR IGNORE INTO settings VALUES ('interval_ms', 1000);",
        )
    })?;

    // Commands arrive on devices/pump-17/commands/#; each sets the sampling interval and
    // acknowledges with an event, both in the transaction that marks the command applied.
    let mqtt = MqttConfig::new(host, port.parse()?)
        .client_id("pump-17")
        .status_topic("devices/pump-17/status");
    let config = RelayConfig::new(mqtt).commands("devices/pump-17/commands/#");
    let relay = Relay::start_with_handler(&outbox, config, |tx, cmd| {
        let interval_ms: i64 = cmd.payload_as()?;
        if !(100..=3_600_000).contains(&interval_ms) {
            // It can never work: rejected for good (marked rejected at once, not a dead letter,
            // and the next command runs), with a reply that tells the sender, published with the
            // rejection. Any other error is retried with backoff, then dead-lettered.
            let why = format!("interval {interval_ms} ms is out of range (100 ms to 1 h)");
            let reply = Message::new(
                "devices/pump-17/events",
                "settings",
                &("rejected", cmd.id.to_string(), why.as_str()),
            )?;
            return Err(Error::reject(why).with_reply(reply));
        }
        tx.execute(
            "UPDATE settings SET value = ?1 WHERE name = 'interval_ms'",
            [interval_ms],
        )?;
        tx.publish(
            "devices/pump-17/events",
            "settings",
            &("interval_ms", interval_ms),
        )?;
        Ok(())
    })?;

    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let celsius = 20.0 + (i % 10) as f64 / 10.0;
        outbox.transaction(|tx| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            tx.execute("INSERT INTO readings VALUES (?1, 'probe-1', ?2)", (now, celsius))?;
            tx.publish("sensors/pump-17/temperature", "probe-1", &celsius)?;
            Ok::<_, Error>(())
        })?;
        let interval: u64 = outbox.with_connection(|c| {
            c.query_row("SELECT value FROM settings WHERE name = 'interval_ms'", [], |r| {
                r.get(0)
            })
        })?;
        if i.is_multiple_of(10) {
            let s = relay.status()?;
            println!(
                "connected={} pending={} oldest={:?} acknowledged={}",
                s.connected, s.store.pending_messages, s.store.oldest_pending_age, s.acknowledged
            );
        }
        i += 1;
        // Sleep the interval, but notice a stop within a tenth of a second.
        let until = Instant::now() + Duration::from_millis(interval);
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100).min(until - Instant::now()));
        }
    }
    println!("stopping: the relay waits briefly for outstanding acknowledgements");
    relay.shutdown()?;
    Ok(())
}
