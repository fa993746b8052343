//! Batching: many small messages of one topic in one MQTT publish, set per topic filter with
//! [`RelayConfig::batch`](crate::RelayConfig::batch). The wire form is in `docs/wire-format.md`
//! ("Batches"); [`Published::decode_all`](crate::Published::decode_all) unpacks it.

use std::time::Duration;

use crate::error::{Error, Result};

/// Largest batch accepted: a decoder refuses to unpack more than this many bytes of envelopes
/// ([`Published::decode_all`](crate::Published::decode_all)), so a small compressed publish
/// cannot make a consumer allocate without bound.
pub const MAX_BATCH_BYTES: usize = 16 * 1024 * 1024;

/// How a compressed batch's envelopes are packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Compression {
    /// No compression: the envelopes travel as a CBOR array (the default).
    #[default]
    None,
    /// zlib (RFC 1950: deflate with a header and an Adler-32 checksum), which Python's standard
    /// `zlib.decompress` and every zlib binding read. Sent only when it makes the batch smaller.
    Zlib,
}

/// How the messages of one topic filter are batched. Setters return `Self`.
///
/// | setting | default |
/// |---|---|
/// | [`max_bytes`](Self::max_bytes) | 16 KiB of envelopes per publish (also held to the connection's maximum packet size) |
/// | [`linger`](Self::linger) | 50 ms |
/// | [`compression`](Self::compression) | [`Compression::None`] |
///
/// ```
/// use std::time::Duration;
/// use edge_outbox::{Batching, Compression, MqttConfig, RelayConfig};
///
/// let config = RelayConfig::new(MqttConfig::new("broker.local", 1883).client_id("pump-17"))
///     .batch(
///         "telemetry/#",
///         Batching::new()
///             .max_bytes(8 * 1024)
///             .linger(Duration::from_millis(200))
///             .compression(Compression::Zlib),
///     );
/// # let _ = config;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct Batching {
    pub(crate) max_bytes: usize,
    pub(crate) linger: Duration,
    pub(crate) compression: Compression,
}

impl Default for Batching {
    fn default() -> Self {
        Self::new()
    }
}

impl Batching {
    /// The defaults (see the table above).
    pub fn new() -> Self {
        Batching {
            max_bytes: 16 * 1024,
            linger: Duration::from_millis(50),
            compression: Compression::None,
        }
    }

    /// Most bytes of encoded envelopes in one batch, before compression (default 16 KiB, at most
    /// [`MAX_BATCH_BYTES`]). A batch is also kept within the connection's maximum packet size. A
    /// message larger than this on its own is published alone.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// How long a partial batch waits for more messages of its topic before it is published
    /// anyway (default 50 ms; zero publishes what is there at once). With a backlog, batches fill
    /// at once and never wait.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// Compress each batch (default [`Compression::None`]).
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.max_bytes == 0 || self.max_bytes > MAX_BATCH_BYTES {
            return Err(Error::InvalidConfig(format!(
                "Batching::max_bytes must be from 1 to {MAX_BATCH_BYTES}, not {}",
                self.max_bytes
            )));
        }
        Ok(())
    }
}
