//! The suite's command fixture: a device with an account balance, a cloud command that adds
//! credits to it (an increment, so a command applied twice shows), and the balance to check.

use edge_outbox::{Envelope, MessageId, Outbox};

/// The account every credit command is for (its ordering key).
pub const ACCOUNT: &str = "acct-7";

/// An `AddCredits` command envelope for `credits`, with a new id, as the cloud sends it.
pub fn command(credits: i64) -> Vec<u8> {
    Envelope {
        id: MessageId::new_v7(),
        source: "cloud".into(),
        epoch: 0,
        seq: 1,
        key: ACCOUNT.into(),
        created_ms: 0,
        event_type: Some("AddCredits".into()),
        headers: vec![],
        payload: edge_outbox::envelope::to_cbor(&credits).expect("cbor").into(),
    }
    .encode()
}

/// A device store ([`super::device::open_device`]) with a `balance` table holding the account
/// at 0.
pub fn device(dir: &std::path::Path) -> Outbox {
    let outbox = super::device::open_device(dir);
    outbox
        .with_connection(|c| {
            c.execute_batch(
                "CREATE TABLE IF NOT EXISTS balance (account TEXT PRIMARY KEY, credits INTEGER NOT NULL);
                 INSERT OR IGNORE INTO balance VALUES ('acct-7', 0);",
            )
        })
        .expect("balance table");
    outbox
}

/// The account's credits now.
pub fn balance(outbox: &Outbox) -> i64 {
    outbox
        .with_connection(|c| c.query_row("SELECT credits FROM balance", [], |r| r.get(0)))
        .expect("balance")
}

/// Starts a relay receiving commands on `filter` whose handler adds the credits (an increment:
/// not idempotent on its own) and, with `receipts`, publishes a receipt on that topic in the same
/// transaction; returns once the command session is subscribed.
pub fn credit_relay(
    outbox: &Outbox,
    config: edge_outbox::RelayConfig,
    filter: &str,
    receipts: Option<&'static str>,
) -> edge_outbox::Relay {
    let relay = edge_outbox::Relay::start_with_handler(outbox, config.commands(filter), move |tx, cmd| {
        let credits: i64 = cmd.payload_as()?;
        tx.execute(
            "UPDATE balance SET credits = credits + ?1 WHERE account = ?2",
            (credits, &cmd.key),
        )?;
        if let Some(topic) = receipts {
            tx.publish(topic, &cmd.key, &cmd.id.to_string())?;
        }
        Ok::<_, edge_outbox::Error>(())
    })
    .expect("relay");
    assert!(
        super::wait_until(|| relay.status().expect("status").commands_connected),
        "command session ready"
    );
    relay
}
