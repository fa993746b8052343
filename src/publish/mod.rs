//! The publishing side of a relay: the publishing core that decides what to publish and what
//! the broker's answers mean (sans-IO: no threads, sockets, clocks or SQLite inside), the
//! publisher thread that drives it, the marker thread that marks what the broker acknowledged,
//! the rows and gap notices they read and write, and the durability barrier in front of
//! publishing. The [`Relay`](crate::Relay) handle starts it beside the command session; neither
//! imports the other. docs/architecture.md draws the seam.

mod batch;
mod core;
mod durability;
mod gaps;
mod lanes;
mod marker;
mod new_rows;
pub(crate) mod pacing;
mod publisher;
mod reader;
mod rows;
mod work;

pub(crate) use durability::{Barrier, wal_path};
pub(crate) use marker::{Marker, Marks};
pub(crate) use publisher::Publisher;
pub(crate) use work::count_steps;
