//! Inbound commands: a persistent MQTT session that stores each delivery in the inbox before
//! acknowledging it, and an optional handler thread that applies them.

mod handler;
mod session;

pub(crate) use handler::{Handler, run_handler};
pub(crate) use session::CommandSession;
