//! Inbound commands: a persistent MQTT session that stores each delivery in the inbox before
//! acknowledging it, and an optional handler thread that applies them.

mod delivery;
mod handler;
mod send;
mod session;

pub(crate) use delivery::DeliveryLimits;
pub(crate) use handler::{Handler, TwoPhase, run_handler};
pub use send::send_command;
pub(crate) use session::{CommandSession, Intake};
