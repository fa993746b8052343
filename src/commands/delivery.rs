//! What the command session does with one delivery, decided from plain values (topic, bytes,
//! retain flag) so it does not depend on the MQTT client's packet types.

use rusqlite::Connection;

use crate::error::Result;
use crate::store::{Delivery, Options, Received, gate, receive_delivery, refuse};

/// The command session's limits on deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeliveryLimits {
    /// Largest delivery (the whole MQTT payload) that is stored.
    pub max_bytes: usize,
    /// Store deliveries that carry the retain flag.
    pub accept_retained: bool,
}

/// The decision for one delivery. Every one is acknowledged afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Decode and store it in the inbox (deduplicated by id).
    Store,
    /// A retained message the broker sends at every subscription: acknowledge, store nothing.
    IgnoreRetained,
    /// Too large to store: dead-letter it without its bytes, with this reason.
    TooLarge(String),
}

pub(crate) fn admit(payload_len: usize, retained: bool, limits: DeliveryLimits) -> Admission {
    if retained && !limits.accept_retained {
        return Admission::IgnoreRetained;
    }
    if payload_len > limits.max_bytes {
        return Admission::TooLarge(format!(
            "command delivery of {payload_len} bytes exceeds the limit of {} bytes \
             (RelayConfig::max_command_bytes); its bytes were not kept",
            limits.max_bytes
        ));
    }
    Admission::Store
}

/// Whether a stored delivery counts as its topic's retained command. With retained commands kept,
/// every one does, whatever its flag: a broker clears the retain flag on a live delivery, so a
/// command published retained while the device was subscribed arrives looking like any other,
/// and comes back, flag set, at every new subscription.
fn as_retained(flag: bool, limits: DeliveryLimits) -> bool {
    if crate::mutant::active("live-not-retained") {
        return flag;
    }
    flag || limits.accept_retained
}

/// What became of a delivery. Whatever it is, the delivery may now be acknowledged.
#[derive(Debug)]
pub(crate) enum Handled {
    /// Stored, found to be a duplicate, or dead-lettered: see [`Received`].
    Received(Received),
    /// A retained delivery, ignored.
    IgnoredRetained,
}

/// One delivery of a burst: its topic, its bytes and its retain flag.
pub(crate) struct Incoming<'a> {
    pub topic: &'a str,
    pub bytes: &'a [u8],
    pub retained: bool,
}

/// Decides, then stores or sets aside each delivery of a burst on the session's connection, in
/// one transaction: one commit (one sync of the file) for all of them, and none of them stored
/// if it fails. In order, so a duplicate within the burst is found as one.
pub(crate) fn handle_burst(
    conn: &Connection,
    options: &Options,
    limits: DeliveryLimits,
    burst: &[Incoming<'_>],
) -> Result<Vec<Handled>> {
    let _turn = gate::enter(conn, options.busy_timeout)?;
    let tx = rusqlite::Transaction::new_unchecked(conn, rusqlite::TransactionBehavior::Immediate)?;
    let handled = burst
        .iter()
        .map(|d| handle_one(&tx, options, limits, d.topic, d.bytes, d.retained))
        .collect::<Result<Vec<_>>>()?;
    tx.commit()?;
    Ok(handled)
}

fn handle_one(
    conn: &Connection,
    options: &Options,
    limits: DeliveryLimits,
    topic: &str,
    bytes: &[u8],
    retained: bool,
) -> Result<Handled> {
    Ok(match admit(bytes.len(), retained, limits) {
        Admission::IgnoreRetained => Handled::IgnoredRetained,
        Admission::TooLarge(reason) => Handled::Received(refuse(conn, options, topic, None, &reason)?),
        Admission::Store => Handled::Received(receive_delivery(
            conn,
            options,
            Delivery {
                topic,
                bytes,
                retained: as_retained(retained, limits),
            },
        )?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: DeliveryLimits = DeliveryLimits {
        max_bytes: 100,
        accept_retained: false,
    };

    #[test]
    fn size_and_retain_decide() {
        assert_eq!(admit(100, false, LIMITS), Admission::Store);
        assert!(matches!(admit(101, false, LIMITS), Admission::TooLarge(r) if r.contains("101 bytes")));
        assert_eq!(admit(10, true, LIMITS), Admission::IgnoreRetained);
        let keep = DeliveryLimits {
            accept_retained: true,
            ..LIMITS
        };
        assert_eq!(admit(10, true, keep), Admission::Store);
        assert!(matches!(admit(101, true, keep), Admission::TooLarge(_)));
    }

    #[test]
    fn with_retained_commands_kept_every_delivery_counts_as_retained() {
        let keep = DeliveryLimits {
            accept_retained: true,
            ..LIMITS
        };
        assert!(as_retained(false, keep));
        assert!(as_retained(true, keep));
        assert!(!as_retained(false, LIMITS));
    }
}
