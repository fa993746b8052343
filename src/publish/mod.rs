//! The publishing side of a relay: the publisher thread that reads the outbox in order and hands
//! rows to the MQTT session, the marker thread that marks what the broker acknowledged, the rows
//! and gap notices they read and write, and the durability barrier in front of publishing. The
//! [`Relay`](crate::Relay) handle starts it beside the command session; neither imports the other.

mod batch;
mod durability;
mod gaps;
mod lanes;
mod marker;
pub(crate) mod pacing;
mod publisher;
mod rows;
mod work;

pub(crate) use durability::{Barrier, wal_path};
pub(crate) use marker::{Marker, Marks};
pub(crate) use publisher::Publisher;
pub(crate) use work::count_steps;
