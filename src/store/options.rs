//! How a store is opened, and the limits every write is checked against.

use std::time::Duration;

use crate::error::{Error, Result};

/// When SQLite waits for the disk. Either way a business row and its message commit or vanish
/// together; the choice is how many recent commits a power cut may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// `synchronous = FULL` (default): a returned commit, and an acknowledged command, survive a
    /// power cut.
    #[default]
    Full,
    /// `synchronous = NORMAL`: fewer flash writes; a power cut may roll back the last commits
    /// (never half of one). A process crash loses nothing.
    Normal,
}

impl Synchronous {
    pub(crate) fn pragma_value(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// What a publish does when the outbox is at a pending-message or pending-byte limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnFull {
    /// Fail the publish with [`Error::StorageFull`]; the caller's transaction rolls back (default).
    #[default]
    Reject,
    /// Delete the oldest pending messages published as evictable until the new one fits, counting
    /// each in [`Stats::evicted`](crate::Stats::evicted); reject if that is not enough.
    EvictOldest,
}

/// Bounds on what the outbox may hold. Checked inside the writing transaction.
///
/// Defaults: payloads up to 64 KiB, no limit on pending messages or bytes, [`OnFull::Reject`],
/// no topics starting with `$`. Every topic is checked at enqueue: non-empty, at most 65,535
/// bytes, no wildcard and no NUL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct Limits {
    max_payload_bytes: usize,
    allow_dollar_topics: bool,
    max_pending_messages: Option<u64>,
    max_pending_bytes: Option<u64>,
    on_full: OnFull,
    classes: Vec<(String, super::class::MessageClass)>,
    /// A cloud's topic rules, with [`Limits::cloud`].
    cloud: Option<crate::cloud_profile::TopicRules>,
    json_payloads: bool,
    /// The file's payload schemas, compiled when the store opens.
    #[cfg(feature = "schemas")]
    pub(crate) schemas: std::sync::Arc<crate::payload_schema::Registry>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload_bytes: 64 * 1024,
            allow_dollar_topics: false,
            max_pending_messages: None,
            max_pending_bytes: None,
            on_full: OnFull::Reject,
            classes: Vec::new(),
            cloud: None,
            json_payloads: false,
            #[cfg(feature = "schemas")]
            schemas: std::sync::Arc::default(),
        }
    }
}

impl Limits {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Largest CBOR payload accepted by a publish, in bytes (default 64 KiB). Keep it below the
    /// broker's packet limit minus the topic and about 100 bytes of envelope.
    pub fn max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// Accept topics that start with `$` (default false: refused with [`Error::InvalidTopic`]).
    /// Brokers reserve such topics (`$SYS/...`, `$aws/...`) and usually refuse or drop publishes
    /// there; allow them only for a broker that documents one you may publish to.
    pub fn allow_dollar_topics(mut self, allow: bool) -> Self {
        self.allow_dollar_topics = allow;
        self
    }

    /// Most messages that may wait in the outbox (default: no limit).
    pub fn max_pending_messages(mut self, n: u64) -> Self {
        self.max_pending_messages = Some(n);
        self
    }

    /// Most payload bytes that may wait in the outbox (default: no limit).
    pub fn max_pending_bytes(mut self, bytes: u64) -> Self {
        self.max_pending_bytes = Some(bytes);
        self
    }

    /// What to do when a limit is reached (default [`OnFull::Reject`]).
    pub fn on_full(mut self, policy: OnFull) -> Self {
        self.on_full = policy;
        self
    }

    /// Gives the messages on topics matching `filter` the defaults of `class` (priority,
    /// coalescing, eviction, lifetime) where the message does not set them itself: storage policy
    /// per class, so telemetry evicts and alarms never do. The first matching filter applies.
    /// Applied when the crate enqueues; a foreign writer (the SQL contract) sets the columns.
    pub fn class(mut self, filter: impl Into<String>, class: super::class::MessageClass) -> Self {
        self.classes.push((filter.into(), class));
        self
    }

    /// The documented limits of `profile`'s cloud, for the device `device_id` (its client id),
    /// checked at every publish: the cloud's topic rules (AWS IoT Core's and Event Grid's length
    /// and depth; Azure IoT Hub's `devices/{device-id}/messages/events/`), refused with
    /// [`Error::InvalidTopic`] naming the cloud and the limit, and as
    /// [`max_payload_bytes`](Self::max_payload_bytes) the cloud's message size less 2 KiB kept
    /// for the envelope and topic ([`Error::PayloadTooLarge`]; a later `max_payload_bytes`
    /// replaces it; the relay checks the whole packet before publishing).
    ///
    /// ```
    /// use edge_outbox::{CloudProfile, Limits, Options, Outbox};
    /// # let dir = tempfile::tempdir()?;
    /// let limits = Limits::new().cloud(CloudProfile::AzureIotHub, "pump-17");
    /// let outbox = Outbox::open_with(dir.path().join("o.db"), Options::new().limits(limits))?;
    /// outbox.transaction(|tx| tx.publish("devices/pump-17/messages/events/", "pump-17", &1))?;
    /// let refused = outbox.transaction(|tx| tx.publish("pumps/17", "pump-17", &1)).unwrap_err();
    /// assert!(refused.to_string().contains("Azure IoT Hub"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn cloud(mut self, profile: crate::CloudProfile, device_id: &str) -> Self {
        self.max_payload_bytes = profile
            .max_message_bytes()
            .saturating_sub(crate::cloud_profile::ENVELOPE_HEADROOM);
        self.cloud = Some(profile.topic_rules(device_id));
        self
    }

    /// Refuse, where it is written, a payload the JSON envelope cannot carry (a byte string, a
    /// tag, a map key that is not text, a number outside 64 bits, NaN or an infinity), with
    /// [`Error::Encode`] naming what and where: for a device whose relay publishes
    /// [`EnvelopeFormat::Json`](crate::envelope::EnvelopeFormat::Json), which would otherwise
    /// dead-letter it. Default false. Rows written through the SQL contract are not checked.
    ///
    /// ```
    /// use edge_outbox::{Limits, Options, Outbox};
    /// # let dir = tempfile::tempdir()?;
    /// let limits = Limits::new().json_payloads(true);
    /// let outbox = Outbox::open_with(dir.path().join("o.db"), Options::new().limits(limits))?;
    /// outbox.transaction(|tx| tx.publish("pumps/17", "", &(21.5, "ok")))?;
    /// let refused = outbox.transaction(|tx| tx.publish("pumps/17", "", &f64::NAN)).unwrap_err();
    /// assert!(refused.to_string().contains("NaN"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn json_payloads(mut self, on: bool) -> Self {
        self.json_payloads = on;
        self
    }

    /// Checks that the JSON envelope can carry `payload`, if asked to.
    pub(crate) fn check_json(&self, payload: &[u8]) -> Result<()> {
        if self.json_payloads {
            crate::envelope::json::payload_to_json(payload).map_err(Error::Encode)?;
        }
        Ok(())
    }

    /// The cloud's topic rules, if [`cloud`](Self::cloud) set them.
    pub(crate) fn cloud_rules(&self) -> Option<&crate::cloud_profile::TopicRules> {
        self.cloud.as_ref()
    }

    /// Checks `topic` against the cloud's rules if any (first: their reasons are the more
    /// precise, `$aws/` for one), then MQTT's.
    pub(crate) fn check_topic(&self, topic: &str) -> Result<()> {
        if let Some(rules) = &self.cloud {
            rules.check(topic)?;
        }
        crate::topic::check(topic, self.allow_dollar_topics)
    }

    pub(crate) fn classes(&self) -> &[(String, super::class::MessageClass)] {
        &self.classes
    }

    /// The payload size limit in bytes.
    pub fn payload_limit(&self) -> usize {
        self.max_payload_bytes
    }

    /// Whether topics starting with `$` are accepted.
    pub fn dollar_topics_allowed(&self) -> bool {
        self.allow_dollar_topics
    }

    /// The pending-message limit, if any.
    pub fn pending_messages_limit(&self) -> Option<u64> {
        self.max_pending_messages
    }

    /// The pending-byte limit, if any.
    pub fn pending_bytes_limit(&self) -> Option<u64> {
        self.max_pending_bytes
    }

    /// The policy when full.
    pub fn full_policy(&self) -> OnFull {
        self.on_full
    }

    pub(crate) fn is_bounded(&self) -> bool {
        self.max_pending_messages.is_some() || self.max_pending_bytes.is_some()
    }

    fn validate(&self) -> Result<()> {
        for (filter, class) in &self.classes {
            class.validate(filter)?;
        }
        if self.max_payload_bytes == 0 {
            return Err(Error::InvalidConfig(
                "max_payload_bytes must be at least 1".into(),
            ));
        }
        if self.max_pending_messages == Some(0) || self.max_pending_bytes == Some(0) {
            return Err(Error::InvalidConfig(
                "a pending limit of 0 would refuse every message; omit it for no limit".into(),
            ));
        }
        Ok(())
    }
}

/// How to open a store. Every setter returns `Self`; [`Outbox::open_with`](crate::Outbox::open_with)
/// validates.
///
/// | setting | default |
/// |---|---|
/// | [`synchronous`](Self::synchronous) | [`Synchronous::Full`] |
/// | [`busy_timeout`](Self::busy_timeout) | 5 s |
/// | [`wal_size_limit`](Self::wal_size_limit) | 4 MiB |
/// | [`page_size`](Self::page_size) | 4096 bytes (SQLite's), for new files |
/// | [`limits`](Self::limits) | [`Limits::default`] |
/// | [`inbox_retention`](Self::inbox_retention) | 7 days |
/// | [`keep_applied_payloads`](Self::keep_applied_payloads) | false |
/// | [`max_attempts`](Self::max_attempts) | 5 |
/// | [`attempt_timeout`](Self::attempt_timeout) | 10 min |
/// | [`retry_backoff`](Self::retry_backoff) | 1 s doubling to 5 min |
/// | [`sent_retention`](Self::sent_retention) | none: acknowledged rows are deleted |
/// | [`integrity_check_budget`](Self::integrity_check_budget) | 1 s |
/// | [`salvage_on_corruption`](Self::salvage_on_corruption) | true |
/// | [`max_refusals`](Self::max_refusals) | 1000 refused deliveries kept |
/// | [`max_refusal_bytes`](Self::max_refusal_bytes) | 4 MiB of their bytes |
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct Options {
    pub(crate) synchronous: Synchronous,
    pub(crate) busy_timeout: Duration,
    pub(crate) wal_size_limit: u64,
    pub(crate) page_size: u32,
    pub(crate) limits: Limits,
    pub(crate) inbox_retention: Duration,
    pub(crate) keep_applied_payloads: bool,
    pub(crate) max_attempts: u32,
    pub(crate) attempt_timeout: Duration,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) sent_retention: Option<Duration>,
    pub(crate) integrity_budget: Duration,
    pub(crate) salvage: bool,
    pub(crate) max_refusals: u64,
    pub(crate) max_refusal_bytes: u64,
    #[cfg(feature = "signed-commands")]
    pub(crate) trusted_keys: Option<crate::signed::TrustedKeys>,
    #[cfg(feature = "schemas")]
    pub(crate) schemas: Vec<crate::payload_schema::EventSchema>,
    #[cfg(feature = "schemas")]
    pub(crate) strict_schemas: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            wal_size_limit: 4 * 1024 * 1024,
            page_size: 4096,
            limits: Limits::default(),
            inbox_retention: Duration::from_secs(7 * 24 * 3600),
            keep_applied_payloads: false,
            max_attempts: 5,
            attempt_timeout: Duration::from_secs(600),
            backoff_min: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            sent_retention: None,
            integrity_budget: Duration::from_secs(1),
            salvage: true,
            max_refusals: 1000,
            max_refusal_bytes: 4 * 1024 * 1024,
            #[cfg(feature = "signed-commands")]
            trusted_keys: None,
            #[cfg(feature = "schemas")]
            schemas: Vec::new(),
            #[cfg(feature = "schemas")]
            strict_schemas: false,
        }
    }
}

impl Options {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Durability of each commit (default [`Synchronous::Full`]).
    pub fn synchronous(mut self, mode: Synchronous) -> Self {
        self.synchronous = mode;
        self
    }

    /// How long a write waits for another connection's lock before failing with
    /// [`Error::Busy`] (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Size the WAL file is truncated back to after a checkpoint (default 4 MiB).
    pub fn wal_size_limit(mut self, bytes: u64) -> Self {
        self.wal_size_limit = bytes;
        self
    }

    /// The database page size for a file created by this open: 512 to 65536, a power of two
    /// (default 4096, SQLite's). An existing file keeps the page size it was created with.
    ///
    /// Every commit writes each page it changed to the WAL in full, and a transaction with one
    /// message changes about three pages (the business row's, the outbox's, the sequence's), so a
    /// device committing one message at a time writes about three pages of flash per message, and
    /// the relay's mark one more. 1024-byte pages cut those bytes by about three quarters; larger
    /// rows and tables then span more pages and lookups walk deeper trees (docs/operations.md,
    /// "Flash wear", has the figures). Any other size is refused by the open
    /// ([`Error::InvalidConfig`]), before the file is created.
    ///
    /// ```
    /// use edge_outbox::{Options, Outbox};
    /// # let dir = tempfile::tempdir()?;
    /// let outbox = Outbox::open_with(dir.path().join("device.db"), Options::new().page_size(1024))?;
    /// let size: u32 = outbox.with_connection(|c| c.query_row("PRAGMA page_size", [], |r| r.get(0)))?;
    /// assert_eq!(size, 1024);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn page_size(mut self, bytes: u32) -> Self {
        self.page_size = bytes;
        self
    }

    /// Limits on payload size and pending storage.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// How long the ids of applied commands (and of dead ones whose dead letter was dropped) are
    /// kept to recognise redeliveries (default 7 days), counted from when they were applied or
    /// died. Make it longer than any redelivery or replay the broker and operators can make: a
    /// command redelivered after its id was pruned is applied again.
    pub fn inbox_retention(mut self, retention: Duration) -> Self {
        self.inbox_retention = retention;
        self
    }

    /// Keep a command's payload after it is applied (default false: drop it, keep only the id).
    pub fn keep_applied_payloads(mut self, keep: bool) -> Self {
        self.keep_applied_payloads = keep;
        self
    }

    /// Handler attempts after which a failing command is dead-lettered (default 5). An attempt
    /// is counted when it starts, so one whose handler takes the process down (abort, out of
    /// memory, a watchdog) counts too: after this many, the command is dead-lettered with
    /// "handler did not return" instead of crashing the device again.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// How long an attempt may run before another worker treats it as abandoned (its worker died
    /// or hung), counts it as failed and may start the next one (default 10 min). The relay's own
    /// handler does not wait for this: when it starts it recovers the attempts it left running.
    /// Set it above the longest a handler may take; a two-phase handler's outside step counts.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// Wait after a failed handler attempt: `min`, doubling per attempt up to `max`
    /// (default 1 s to 5 min).
    pub fn retry_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// Keep acknowledged outbox rows in `outbox_sent` for this long instead of deleting them
    /// (default: delete on acknowledgement).
    pub fn sent_retention(mut self, retention: Duration) -> Self {
        self.sent_retention = Some(retention);
        self
    }

    /// Accept only commands signed by one of these keys (feature `signed-commands`; default:
    /// commands are not signed). A delivery that is not a valid signed command is dead-lettered
    /// with the reason, before anything is stored as applicable. See [`TrustedKeys`](crate::TrustedKeys)
    /// and docs/wire-format.md.
    ///
    /// The first open with keys records them in the file, and from then on every handle on it
    /// verifies with the file's keys, this option or not. A later open must give the same keys
    /// and window, or fails with [`Error::InvalidConfig`]: change them with
    /// [`Outbox::require_signed_commands`](crate::Outbox::require_signed_commands).
    #[cfg(feature = "signed-commands")]
    pub fn trusted_command_keys(mut self, keys: crate::signed::TrustedKeys) -> Self {
        self.trusted_keys = Some(keys);
        self
    }

    /// Registers a payload schema (feature `schemas`): every message published on a topic its
    /// filter matches is checked against it inside the writing transaction, and one that does not
    /// match fails it with [`Error::SchemaViolation`]. The relay checks rows written through the
    /// SQL contract before it publishes them: one that does not match is dead-lettered with the
    /// reason and announced as a gap. See [`EventSchema`](crate::EventSchema) and
    /// docs/schemas.md.
    ///
    /// The schema is recorded in the file when the store opens, so every later handle, relay and
    /// CLI checks with it too. A version already in the file must be given unchanged, and a new
    /// version may only add optional fields to the version before it: otherwise the open fails
    /// with [`Error::InvalidConfig`] naming the rule the change breaks.
    #[cfg(feature = "schemas")]
    pub fn schema(mut self, schema: crate::payload_schema::EventSchema) -> Self {
        self.schemas.push(schema);
        self
    }

    /// Refuses messages on topics no schema covers (feature `schemas`; default off: they pass).
    #[cfg(feature = "schemas")]
    pub fn strict_schemas(mut self, strict: bool) -> Self {
        self.strict_schemas = strict;
        self
    }

    /// The configured durability mode.
    pub fn synchronous_mode(&self) -> Synchronous {
        self.synchronous
    }

    /// The configured limits.
    pub fn storage_limits(&self) -> &Limits {
        &self.limits
    }

    /// How long the integrity check on open may take (default 1 s; zero skips it). SQLite's
    /// `quick_check` reads every page; one that does not finish in time is abandoned (logged),
    /// and the file is used as it is. Raise it for large files on slow storage, or run
    /// `edge-outbox doctor`, which has no limit. A running relay checks again now and then
    /// ([`RelayConfig::integrity_check_interval`](crate::RelayConfig::integrity_check_interval)).
    pub fn integrity_check_budget(mut self, budget: Duration) -> Self {
        self.integrity_budget = budget;
        self
    }

    /// What opening does with a damaged file (default true: salvage it). A file that fails the
    /// integrity check, or that SQLite reports as corrupt while opening, is moved aside (renamed
    /// `<name>.corrupt-<unix ms>`, with its WAL), and everything still readable (the
    /// application's tables, pending messages, commands, dead letters) is copied into a fresh
    /// file at the same path, which numbers new messages in a new epoch; pending messages that
    /// could not be read are announced to the cloud as an `unrecoverable` gap. Logged at ERROR
    /// and counted ([`Stats::salvaged`](crate::Stats::salvaged)). With false, opening fails with
    /// [`Error::Corrupt`] and leaves the file alone (`edge-outbox doctor --salvage` does the
    /// same by hand).
    pub fn salvage_on_corruption(mut self, salvage: bool) -> Self {
        self.salvage = salvage;
        self
    }

    /// Most dead letters of refused deliveries (malformed, not signed, too large) kept at once
    /// (default 1000). Anyone who can publish on the command topic can make them, and each is
    /// stored before anything else, signatures included: past this, the oldest are evicted,
    /// counted in [`Stats::refusals_evicted`](crate::Stats::refusals_evicted), so a flood cannot
    /// take the storage the application's own writes need. Dead letters of commands that were
    /// stored (a handler's failures and rejections) are not counted here, nor ever evicted.
    pub fn max_refusals(mut self, count: u64) -> Self {
        self.max_refusals = count;
        self
    }

    /// Most raw bytes the kept refused deliveries may hold together (default 4 MiB); past this,
    /// the oldest are evicted as with [`max_refusals`](Self::max_refusals). A single refusal
    /// larger than this is kept without its bytes, and cannot be retried.
    pub fn max_refusal_bytes(mut self, bytes: u64) -> Self {
        self.max_refusal_bytes = bytes;
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        self.limits.validate()?;
        if self.max_refusals == 0 {
            return Err(Error::InvalidConfig(
                "max_refusals must be at least 1: the newest refusal is what an operator looks at".into(),
            ));
        }
        if self.max_attempts == 0 {
            return Err(Error::InvalidConfig("max_attempts must be at least 1".into()));
        }
        if !(512..=65_536).contains(&self.page_size) || !self.page_size.is_power_of_two() {
            return Err(Error::InvalidConfig(format!(
                "page_size must be a power of two from 512 to 65536, got {}",
                self.page_size
            )));
        }
        #[cfg(feature = "signed-commands")]
        if let Some(keys) = &self.trusted_keys {
            keys.validate(self.inbox_retention)?;
        }
        if self.attempt_timeout.is_zero() {
            return Err(Error::InvalidConfig("attempt_timeout must be above zero".into()));
        }
        if self.backoff_min > self.backoff_max {
            return Err(Error::InvalidConfig(format!(
                "retry_backoff minimum {:?} is above its maximum {:?}",
                self.backoff_min, self.backoff_max
            )));
        }
        Ok(())
    }

    /// The wait before attempt `attempts + 1`, after `attempts` failures.
    pub(crate) fn backoff_after(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(31);
        self.backoff_min
            .saturating_mul(1u32 << doublings)
            .min(self.backoff_max)
    }
}
