//! A retained command that first arrives live is applied once. Brokers clear the retain flag on
//! live deliveries, so the device cannot tell it from any other command; the broker sends it again,
//! retain flag set, at every new subscription, long after the inbox retention. With
//! `retained_commands(true)` every stored command counts as its topic's retained one, so its id is
//! kept while it is the newest on its topic and the resend is a duplicate.

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, command_bytes, temp_db};
use edge_outbox::{MessageId, Options};
use rumqttc::QoS;
use support::device::relay_config;
use support::ledger::{balance, open, start};
use support::{Broker, publish_retained, wait_until};

const FILTER: &str = "devices/d1/commands/#";
const TOPIC: &str = "devices/d1/commands/setpoint";

#[test]
fn a_retained_command_delivered_live_is_not_applied_again_at_the_next_subscription() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    // No retention at all: only being its topic's retained command keeps the id.
    let outbox = open(&path, Options::new().inbox_retention(Duration::ZERO))?;
    // A new command session each time: every broker sends retained messages to a new subscription.
    let config = |session: &str| {
        relay_config(broker.addr(), "retained-live")
            .retained_commands(true)
            .commands_client_id(format!("retained-live-{session}"))
    };
    let relay = start(&outbox, config("first"), FILTER)?;
    // Published retained while the device is subscribed: delivered live, retain flag cleared.
    publish_retained(
        broker.addr(),
        TOPIC,
        &command_bytes(MessageId::new_v7(), "acct", &100)?,
        QoS::AtLeastOnce,
    )?;
    assert!(
        wait_until(|| balance(&outbox) == 100),
        "the live command was not applied"
    );
    relay.shutdown()?;
    outbox.prune()?;

    // The next subscription gets it again, retain flag set: recognised, not applied.
    let relay = start(&outbox, config("second"), FILTER)?;
    let settled =
        wait_until(|| balance(&outbox) != 100 || relay.status().is_ok_and(|s| s.commands_duplicate >= 1));
    let status = relay.status()?;
    relay.shutdown()?;
    publish_retained(broker.addr(), TOPIC, &[], QoS::AtLeastOnce)?;
    assert!(
        settled,
        "the retained command was not sent again ({:?})",
        broker.kind()
    );
    assert_eq!(balance(&outbox), 100, "applied twice: {status:?}");
    Ok(())
}

/// The broken build this scenario catches: a live delivery stored as not retained.
#[cfg(feature = "mutants")]
#[test]
fn the_live_not_retained_mutant_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    let test = "a_retained_command_delivered_live_is_not_applied_again_at_the_next_subscription";
    assert!(
        support::mutant::caught(test, "live-not-retained")?,
        "mutant survived"
    );
    Ok(())
}
