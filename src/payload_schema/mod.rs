//! Payload schemas (feature `schemas`): a CDDL schema per event type and version, registered for a
//! topic filter, checked where the event is written and again by the relay before it publishes a
//! row some other writer committed.
//!
//! The schemas live in the file (`edge_outbox_schemas`), so every handle, the relay, the CLI and a
//! foreign writer see one contract. A version is never changed once registered, and a new
//! version may only add optional fields to the one before it (see `compat`).

mod compat;
mod nesting;
mod path;
mod published;
mod registry;
mod schemas;
mod stamp;
mod table;

pub(crate) use published::encode as encode_published;
pub use registry::EventSchema;
pub(crate) use registry::Registry;
pub use schemas::Schemas;
pub(crate) use stamp::{check_and_stamp, headers, version_of};
pub(crate) use table::{adopt_on_open, compile_all, reloaded};
