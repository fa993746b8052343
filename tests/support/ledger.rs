//! A device whose commands credit a balance, behind a relay: how the retained-command scenarios
//! tell a command applied once from one applied twice.

use std::path::Path;

use edge_outbox::{Command, Error, Options, Outbox, Relay, RelayConfig, Tx};

use super::wait_until;

type TestResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The store at `path` with a `balance` table holding one row at 0.
pub fn open(path: &Path, options: Options) -> TestResult<Outbox> {
    let outbox = Outbox::open_with(path, options)?;
    outbox.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS balance (credits INTEGER NOT NULL);
             INSERT INTO balance SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM balance);",
        )
    })?;
    Ok(outbox)
}

/// A relay receiving commands on `filter`, each adding its payload to the balance; returns once
/// its command session has subscribed.
pub fn start(outbox: &Outbox, config: RelayConfig, filter: &str) -> TestResult<Relay> {
    let relay = Relay::start_with_handler(
        outbox,
        config.commands(filter),
        |tx: &mut Tx<'_>, cmd: &Command| {
            let credits: i64 = cmd.payload_as()?;
            tx.execute("UPDATE balance SET credits = credits + ?1", [credits])?;
            Ok::<_, Error>(())
        },
    )?;
    if !wait_until(|| relay.status().is_ok_and(|s| s.commands_connected)) {
        return Err("the command session never subscribed".into());
    }
    Ok(relay)
}

/// The balance now (-1 if it cannot be read).
pub fn balance(outbox: &Outbox) -> i64 {
    outbox
        .with_connection(|c| c.query_row("SELECT credits FROM balance", [], |r| r.get(0)))
        .unwrap_or(-1)
}
