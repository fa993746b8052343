//! A retained command replaced at the broker by a newer one is pruned, whatever the retain flag
//! of the deliveries: the newer command arrives live (flag cleared), and still the older id goes
//! after the retention while the newer one, now its topic's retained command, stays.

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
fn a_retained_command_replaced_by_a_live_one_is_pruned_and_the_live_one_kept() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new().inbox_retention(Duration::ZERO))?;
    let (old, new) = (MessageId::new_v7(), MessageId::new_v7());
    // Retained before the device subscribes: delivered with the retain flag.
    publish_retained(
        broker.addr(),
        TOPIC,
        &command_bytes(old, "acct", &100)?,
        QoS::AtLeastOnce,
    )?;
    let relay = start(
        &outbox,
        relay_config(broker.addr(), "retained-replaced").retained_commands(true),
        FILTER,
    )?;
    assert!(
        wait_until(|| balance(&outbox) == 100),
        "the retained command was not applied"
    );
    // Its replacement, published retained while the device is subscribed: delivered live.
    publish_retained(
        broker.addr(),
        TOPIC,
        &command_bytes(new, "acct", &1)?,
        QoS::AtLeastOnce,
    )?;
    assert!(
        wait_until(|| balance(&outbox) == 101),
        "the replacement was not applied"
    );
    relay.shutdown()?;
    publish_retained(broker.addr(), TOPIC, &[], QoS::AtLeastOnce)?;
    outbox.prune()?;
    let kept: Vec<Vec<u8>> = outbox.with_connection(|c| {
        c.prepare("SELECT id FROM inbox ORDER BY seq")?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()
    })?;
    assert_eq!(
        kept,
        [new.as_bytes().to_vec()],
        "only the topic's retained command is kept"
    );
    Ok(())
}
