//! The device under test: a realistic workload in a child process that the scenarios kill.
//!
//! It commits orders (a business row and its message, several keys), runs a relay with a command
//! session, and applies commands whose effect is a balance increment (not idempotent on its own,
//! so a double apply shows). It resumes after a restart from what its database holds, and exits
//! once every order is committed and published and every expected command is applied.

use std::io::Write;
use std::time::Duration;

use edge_outbox::{
    Batching, Compression, Error, Message, MqttConfig, Options, Outbox, Relay, RelayConfig, Status,
    Synchronous,
};

/// How the orchestrator configures a device run (environment variables, so a restart is the same
/// command line).
pub struct DeviceEnv;

impl DeviceEnv {
    pub const DB: &'static str = "CRASH_DEVICE_DB";
    pub const BROKER: &'static str = "CRASH_DEVICE_BROKER";
    pub const ORDERS: &'static str = "CRASH_DEVICE_ORDERS";
    pub const COMMANDS: &'static str = "CRASH_DEVICE_COMMANDS";
    pub const PACE_US: &'static str = "CRASH_DEVICE_PACE_US";
    pub const MAX_PAGES: &'static str = "CRASH_DEVICE_MAX_PAGES";
    pub const KEEP_SENT: &'static str = "CRASH_DEVICE_KEEP_SENT";
    /// `normal`: the device's store runs with `synchronous = NORMAL` (default FULL).
    pub const SYNC: &'static str = "CRASH_DEVICE_SYNC";
    /// Every n-th order attempt publishes and then rolls back (default 7; 0: never).
    pub const ROLLBACK_EVERY: &'static str = "CRASH_DEVICE_ROLLBACK_EVERY";
    /// Set: orders go out in priority lanes (one priority per key), [`COALESCING_KEY`]'s orders
    /// coalesce, [`EXPIRING_KEY`]'s expire after [`LIFETIME`], and the relay is paced below the
    /// load (issue 13's options under the same kills).
    pub const LANES: &'static str = "CRASH_DEVICE_LANES";
    /// Set: every order goes on one topic, `orders/batched`, which the relay batches (with
    /// zlib and a short linger), so that batches form whatever the key.
    pub const BATCH: &'static str = "CRASH_DEVICE_BATCH";
    /// Set: commands arrive on the publishing session (`RelayConfig::single_session`).
    pub const SINGLE_SESSION: &'static str = "CRASH_DEVICE_SINGLE_SESSION";
    /// Set: publish without MQTT 5's message expiry interval (against rumqttd 0.20, whose 3.1.1
    /// listener, the orchestrator's subscriber, crashes on MQTT 5 properties).
    pub const NO_MESSAGE_EXPIRY: &'static str = "CRASH_DEVICE_NO_MESSAGE_EXPIRY";
}

/// With [`DeviceEnv::LANES`]: the key whose orders are latest values (the older ones unpublished
/// are replaced, and announced as `coalesced`).
pub const COALESCING_KEY: &str = "k4";
/// With [`DeviceEnv::LANES`]: the key whose orders expire (announced as `expired`).
pub const EXPIRING_KEY: &str = "k3";
/// Long enough for most orders, short enough that some wait longer while the device is down.
pub const LIFETIME: Duration = Duration::from_millis(1500);

/// Set (to the number of commands it must have applied by then) when the orchestrator asks this
/// device to stop committing and drain what it has: after a scenario's faults, so the process
/// that lived through them must show it recovered. Negative: not asked.
pub static FINISH: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(-1);

/// The amount a rolled-back order announces: no committed order has it, so a delivered message
/// carrying it is a phantom whatever its number.
pub const ROLLED_BACK: i64 = -1;

pub const COMMAND_FILTER: &str = "device/commands/#";
/// The device's MQTT client ids: publishing, and the persistent command session.
pub const CLIENT_ID: &str = "crash-device";
pub const COMMAND_CLIENT_ID: &str = "crash-device-commands";
pub const KEYS: usize = 5;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn num(name: &str, default: u64) -> u64 {
    var(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

pub fn order_key(n: i64) -> String {
    format!("k{}", n % KEYS as i64)
}

/// Says "ready" when the command session has just (re)subscribed.
fn announce(subscribed: &mut bool, now: bool) {
    if now && !*subscribed {
        say("ready");
    }
    *subscribed = now;
}

/// Prints a protocol line for the orchestrator and flushes, so it is seen before a kill.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

pub fn run() -> Result<(), Error> {
    let db = var(DeviceEnv::DB).ok_or_else(|| Error::InvalidConfig("CRASH_DEVICE_DB unset".into()))?;
    let broker =
        var(DeviceEnv::BROKER).ok_or_else(|| Error::InvalidConfig("CRASH_DEVICE_BROKER unset".into()))?;
    let orders = num(DeviceEnv::ORDERS, 500) as i64;
    let commands = num(DeviceEnv::COMMANDS, 0) as i64;
    let pace = Duration::from_micros(num(DeviceEnv::PACE_US, 0));

    let rollback_every = num(DeviceEnv::ROLLBACK_EVERY, 7);
    let mut options = Options::new();
    if var(DeviceEnv::SYNC).as_deref() == Some("normal") {
        options = options.synchronous(Synchronous::Normal);
    }
    if var(DeviceEnv::KEEP_SENT).is_some() {
        // Acknowledged rows are kept, so the checker can tell a broker's loss from the device's.
        options = options.sent_retention(Duration::from_secs(86_400));
    }
    let outbox = Outbox::open_with(&db, options)?;
    outbox.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS orders (n INTEGER PRIMARY KEY, key TEXT NOT NULL, amount INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS accounts (account TEXT PRIMARY KEY, balance INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS ledger (command_id BLOB NOT NULL, account TEXT NOT NULL, amount INTEGER NOT NULL);",
        )
    })?;
    if let Some(pages) = var(DeviceEnv::MAX_PAGES) {
        outbox.with_connection(|c| c.pragma_update(None, "max_page_count", pages))?;
    }

    let (host, port) = broker
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
        .ok_or_else(|| Error::InvalidConfig(format!("bad broker address {broker}")))?;
    let mqtt = MqttConfig::new(host, port)
        .client_id(CLIENT_ID)
        .keep_alive(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(2))
        .message_expiry(var(DeviceEnv::NO_MESSAGE_EXPIRY).is_none());
    let lanes = var(DeviceEnv::LANES).is_some();
    let mut config = RelayConfig::new(mqtt);
    if lanes {
        // A pace below what the device commits, so a backlog builds (and coalesces and expires).
        config = config
            .expire_after(format!("orders/{EXPIRING_KEY}"), LIFETIME)
            .pace_messages(1_500);
    }
    let mut config = if var(DeviceEnv::SINGLE_SESSION).is_some() {
        config.single_session(true)
    } else {
        config.commands_client_id(COMMAND_CLIENT_ID)
    };
    config = config
        .commands(COMMAND_FILTER)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(300));
    let batched = var(DeviceEnv::BATCH).is_some();
    if batched {
        config = config.batch(
            "orders/#",
            Batching::new()
                .max_bytes(2048)
                .linger(Duration::from_millis(20))
                .compression(Compression::Zlib),
        );
    }
    let topic = |key: &str| {
        if batched {
            "orders/batched".to_owned()
        } else {
            format!("orders/{key}")
        }
    };
    // Which layout this run has, before anything can crash it: a scenario checks that its
    // option took effect.
    say(if config.is_single_session() {
        "sessions single"
    } else {
        "sessions two"
    });
    let relay = Relay::start_with_handler(&outbox, config, |tx, cmd| {
        let amount: i64 = cmd.payload_as()?;
        tx.execute("INSERT OR IGNORE INTO accounts VALUES (?1, 0)", [&cmd.key])?;
        tx.execute(
            "UPDATE accounts SET balance = balance + ?1 WHERE account = ?2",
            (amount, &cmd.key),
        )?;
        // Half of the effect is written: a crash here must roll all of it back.
        edge_outbox::failpoint::hit("handler-mid-effect");
        tx.execute(
            "INSERT INTO ledger VALUES (?1, ?2, ?3)",
            (cmd.id.as_bytes().as_slice(), &cmd.key, amount),
        )?;
        tx.publish("device/receipts", &cmd.key, &cmd.id.to_string())?;
        Ok::<_, Error>(())
    })?;

    // "ready" on every (re)subscription of the command session, so the orchestrator knows when
    // commands it sends will be queued for this device.
    let mut subscribed = false;
    let next: i64 = outbox.with_connection(|c| {
        c.query_row(
            "SELECT coalesce(max(n), 0) + 1 FROM orders WHERE n < ?1",
            [super::writer::WRITER_BASE],
            |r| r.get(0),
        )
    })?;
    let mut full_reported = false;
    let mut reported = Reported::default();
    let mut n = next;
    let mut attempt: u64 = 0;
    let finishing = || FINISH.load(std::sync::atomic::Ordering::Relaxed) >= 0;
    while n <= orders && !finishing() {
        let status = relay.status()?;
        announce(&mut subscribed, status.commands_connected);
        reported.say_if_changed(&status);
        let key = order_key(n);
        attempt += 1;
        if rollback_every > 0 && attempt.is_multiple_of(rollback_every) {
            // A transaction that publishes and then fails: neither its row nor its message may
            // ever be seen.
            let declined = outbox.transaction(|tx| {
                tx.execute("INSERT INTO orders VALUES (?1, ?2, ?3)", (n, &key, ROLLED_BACK))?;
                tx.publish(&topic(&key), &key, &(n, &key, ROLLED_BACK))?;
                Err::<(), _>(Error::InvalidConfig("declined".into()))
            });
            match declined {
                Err(Error::InvalidConfig(_)) => {}
                Err(Error::DiskFull | Error::StorageFull { .. } | Error::Busy) => {}
                other => {
                    return Err(Error::InvalidConfig(format!(
                        "a declined transaction returned {other:?}"
                    )));
                }
            }
        }
        let result = outbox.transaction(|tx| {
            tx.execute("INSERT INTO orders VALUES (?1, ?2, ?3)", (n, &key, n * 10))?;
            if lanes {
                // One priority per key: the lanes keep each key's order.
                let lane = (n % KEYS as i64 % 4) as u8;
                let message = Message::new(format!("orders/{key}"), key.as_str(), &(n, &key, n * 10))?
                    .coalescing(key == COALESCING_KEY);
                tx.send(&message.priority(lane))?;
            } else {
                tx.publish(&topic(&key), &key, &(n, &key, n * 10))?;
            }
            Ok::<_, Error>(())
        });
        match result {
            Ok(_) => {
                // What the orchestrator holds the store to: a returned commit must survive.
                say(&format!("committed {n}"));
                edge_outbox::failpoint::hit("after-commit-returned");
                n += 1;
            }
            // A full disk or a busy file: nothing was written; wait for space and retry.
            Err(Error::DiskFull | Error::StorageFull { .. } | Error::Busy) => {
                if !full_reported {
                    say("full");
                    full_reported = true;
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(e),
        }
        if !pace.is_zero() {
            std::thread::sleep(pace);
        }
    }
    // Publish everything and apply every expected command, then stop cleanly. What is left is
    // said as it changes, so the orchestrator sees a run that no longer moves.
    let mut waiting = String::new();
    loop {
        let status = relay.status()?;
        announce(&mut subscribed, status.commands_connected);
        reported.say_if_changed(&status);
        let (applied, effects): (i64, i64) = outbox.with_connection(|c| {
            c.query_row(
                "SELECT (SELECT count(*) FROM inbox WHERE applied_at IS NOT NULL),
                        (SELECT count(*) FROM ledger)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
        })?;
        let commands = commands.max(FINISH.load(std::sync::atomic::Ordering::Relaxed));
        if status.store.pending_messages == 0 && status.store.inbox_unapplied == 0 && applied >= commands {
            break;
        }
        let mut now = format!(
            "waiting pending={} unapplied={} applied={applied}/{commands} effects={effects}",
            status.store.pending_messages, status.store.inbox_unapplied
        );
        if status.store.inbox_unapplied > 0 {
            now.push_str(&outbox.with_connection(unapplied_commands)?);
        }
        if now != waiting {
            say(&now);
            waiting = now;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = relay.status()?;
    reported.say_if_changed(&status);
    relay.shutdown()?;
    say("done");
    Ok(())
}

/// The relay's connection counters as last said to the orchestrator (`status ...` lines), which
/// checks that the faults it injected were experienced.
#[derive(Default, PartialEq, Eq)]
struct Reported {
    connected: bool,
    connections: u64,
    disconnects: u64,
    resent: u64,
}

impl Reported {
    fn say_if_changed(&mut self, status: &Status) {
        let now = Reported {
            connected: status.connected,
            connections: status.connections,
            disconnects: status.disconnects,
            resent: status.resent,
        };
        if now != *self {
            say(&format!(
                "status connected={} connections={} disconnects={} resent={}",
                now.connected, now.connections, now.disconnects, now.resent
            ));
            *self = now;
        }
    }
}

/// The oldest unapplied commands as the inbox holds them, so a stalled run says why each waits.
fn unapplied_commands(c: &rusqlite::Connection) -> rusqlite::Result<String> {
    let mut stmt = c.prepare(
        "SELECT seq, key, attempts, max(next_attempt_at - CAST(unixepoch('subsec') * 1000 AS INTEGER), 0),
                attempt_started_at IS NOT NULL, coalesce(claimed_by, '-'), coalesce(last_error, '-')
         FROM inbox WHERE applied_at IS NULL AND dead_at IS NULL ORDER BY seq LIMIT 4",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(format!(
            " [seq {} key {} attempts {} due in {}ms running {} by {} error {}]",
            r.get::<_, i64>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, i64>(2)?,
            r.get::<_, i64>(3)?,
            r.get::<_, bool>(4)?,
            r.get::<_, String>(5)?,
            r.get::<_, String>(6)?,
        ))
    })?;
    rows.collect()
}
