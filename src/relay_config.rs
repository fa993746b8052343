//! How a relay runs: [`RelayConfig`], read by the publisher and the command session that the
//! [`Relay`](crate::Relay) starts. Its own module so that both stand on it without importing the
//! handle that starts them.

use std::time::Duration;

use crate::batching::Batching;
use crate::error::{Error, Result};
use crate::mqtt::MqttConfig;
use crate::topic::validate_filter;

/// Shutdown waits at most this long for in-flight PUBACKs by default.
pub(crate) const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The rates a relay is held to ([`RelayConfig::pace_messages`], [`RelayConfig::pace_bytes`]);
/// `None`: no limit on that measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct PaceRates {
    pub messages: Option<u32>,
    pub bytes: Option<u64>,
}

impl PaceRates {
    pub(crate) fn is_off(&self) -> bool {
        self.messages.is_none() && self.bytes.is_none()
    }
}

/// How the relay runs. Setters return `Self`; [`Relay::start`](crate::Relay::start) validates.
///
/// | setting | default |
/// |---|---|
/// | [`source`](Self::source) | the MQTT client id |
/// | [`max_in_flight`](Self::max_in_flight) | 100 |
/// | [`poll_interval`](Self::poll_interval) | 50 ms (where the file cannot be watched) |
/// | [`reconnect_backoff`](Self::reconnect_backoff) | 100 ms doubling to 10 s, with jitter |
/// | [`shutdown_timeout`](Self::shutdown_timeout) | 5 s |
/// | [`prune_interval`](Self::prune_interval) | 10 min |
/// | [`ack_timeout`](Self::ack_timeout) | 60 s |
/// | [`poison_disconnects`](Self::poison_disconnects) | 3 |
/// | [`commands`](Self::commands) | none: publish only, one MQTT session |
/// | [`max_command_bytes`](Self::max_command_bytes) | 64 KiB |
/// | [`command_read_limit`](Self::command_read_limit) | 16 MiB |
/// | [`retained_commands`](Self::retained_commands) | false: retained deliveries are ignored |
/// | [`status_file`](Self::status_file) | false |
/// | `metrics_file` (feature `metrics`) | none |
/// | [`integrity_check_interval`](Self::integrity_check_interval) | 1 h |
/// | [`batch`](Self::batch) | none: one message per publish |
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct RelayConfig {
    pub(crate) mqtt: MqttConfig,
    pub(crate) source: String,
    pub(crate) max_in_flight: usize,
    pub(crate) poll_interval: Duration,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) prune_interval: Duration,
    pub(crate) ack_timeout: Duration,
    pub(crate) poison_disconnects: u32,
    pub(crate) commands: Option<String>,
    pub(crate) commands_client_id: Option<String>,
    pub(crate) single_session: bool,
    pub(crate) cloud: Option<crate::CloudProfile>,
    pub(crate) routing_fields: bool,
    pub(crate) format: crate::envelope::EnvelopeFormat,
    pub(crate) max_command_bytes: usize,
    pub(crate) command_read_limit: usize,
    pub(crate) retained_commands: bool,
    pub(crate) status_file: bool,
    pub(crate) metrics_file: Option<std::path::PathBuf>,
    pub(crate) metrics_file_mode: u32,
    pub(crate) integrity_interval: Duration,
    /// Default lifetimes by topic filter, first match wins.
    pub(crate) ttl: Vec<(String, Duration)>,
    pub(crate) pace: PaceRates,
    /// Topic filters whose messages are batched, in the order given (the first match applies).
    pub(crate) batching: Vec<(String, Batching)>,
    /// Where the file's payload schemas are published, retained.
    #[cfg(feature = "schemas")]
    pub(crate) schema_topic: Option<String>,
}

impl RelayConfig {
    /// A relay publishing to the broker in `mqtt`.
    pub fn new(mqtt: MqttConfig) -> Self {
        RelayConfig {
            source: mqtt.id().to_owned(),
            mqtt,
            max_in_flight: 100,
            poll_interval: Duration::from_millis(50),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            prune_interval: Duration::from_secs(600),
            ack_timeout: Duration::from_secs(60),
            poison_disconnects: 3,
            commands: None,
            commands_client_id: None,
            single_session: false,
            cloud: None,
            routing_fields: false,
            format: crate::envelope::EnvelopeFormat::Cbor,
            max_command_bytes: 64 * 1024,
            command_read_limit: 16 * 1024 * 1024,
            retained_commands: false,
            status_file: false,
            metrics_file: None,
            metrics_file_mode: 0o600,
            integrity_interval: Duration::from_secs(3600),
            ttl: Vec::new(),
            pace: PaceRates::default(),
            batching: Vec::new(),
            #[cfg(feature = "schemas")]
            schema_topic: None,
        }
    }

    /// Publishes the file's payload schemas (feature `schemas`), retained, to `topic` at every
    /// connection, so cloud consumers can fetch the contract of what they receive
    /// ([`EventSchema::decode_published`](crate::EventSchema::decode_published)). QoS 0, sent again
    /// at each connection; not a message of the outbox, so not numbered.
    #[cfg(feature = "schemas")]
    pub fn publish_schemas(mut self, topic: impl Into<String>) -> Self {
        self.schema_topic = Some(topic.into());
        self
    }

    /// Write `<db>.relay-status.json` while running, as `edge-outbox relay` does, so that
    /// `edge-outbox status` (and any other process: [`RelayReport::read`](crate::RelayReport::read)) sees this relay's
    /// connection, counters and current error (default false). It is rewritten when something
    /// changes (at most once a second) and at least every 30 s, and removed at shutdown.
    pub fn status_file(mut self, on: bool) -> Self {
        self.status_file = on;
        self
    }

    /// Keep a file of the store's and this relay's metrics in the Prometheus text format at
    /// `path`, for node_exporter's textfile collector (`--collector.textfile.directory`; name it
    /// `*.prom`). Written like the status file (see [`status_file`](Self::status_file)), through
    /// a temporary file renamed over it, and removed at shutdown. See [`crate::metrics`].
    #[cfg(feature = "metrics")]
    pub fn metrics_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.metrics_file = Some(path.into());
        self
    }

    /// The permission bits of the metrics file (default `0o600`, the owner only, like the
    /// database: the figures say how busy the device is and which broker it uses). node_exporter's
    /// textfile collector usually runs as another user: `0o640` lets the file's group read it (run
    /// the relay with that group, e.g. systemd's `Group=`), `0o644` everyone. Set exactly, whatever
    /// the umask. Bits beyond `0o644` (write or execute for anyone but the owner) fail
    /// [`Relay::start`](crate::Relay::start) with [`Error::InvalidConfig`](crate::Error::InvalidConfig).
    ///
    /// ```
    /// # let dir = tempfile::tempdir().expect("temp dir");
    /// let config = edge_outbox::RelayConfig::new(edge_outbox::MqttConfig::new("127.0.0.1", 1883))
    ///     .metrics_file(dir.path().join("edge_outbox.prom"))
    ///     .metrics_file_mode(0o640);
    /// # let _ = config;
    /// ```
    #[cfg(feature = "metrics")]
    pub fn metrics_file_mode(mut self, mode: u32) -> Self {
        self.metrics_file_mode = mode;
        self
    }

    /// The `src` field of every envelope (default: the MQTT client id).
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
    }

    /// Most messages published and not yet acknowledged (default 100, at most 65535).
    ///
    /// A broker whose receive maximum is lower (mosquitto's default is 20) gets no more than that
    /// on the wire; the rest waits in the MQTT client's queue and goes out as the broker's
    /// acknowledgements free slots. A message with a lifetime waits for a free slot instead, and
    /// a session shared with commands ([`single_session`](Self::single_session) with
    /// [`commands`](Self::commands)) queues nothing. An alarm committed during a drain waits
    /// behind up to this many messages: lower it on a slow link.
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// How often an idle relay checks the file for rows committed by other processes or other
    /// handles where it cannot watch the file (default 50 ms; a cheap `PRAGMA data_version`).
    ///
    /// Commits through the same [`Outbox`](crate::Outbox) handle wake the relay at once. On Linux the relay also
    /// watches the WAL file (inotify), which every commit writes to, and wakes on its changes:
    /// other processes' commits are seen at once too, and an idle relay checks the file only
    /// every 2 s (or at this interval, if longer) as a safety net. Elsewhere, or where inotify is
    /// refused (its per-user limits), this interval is how soon such a commit is seen.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Wait between connection attempts: from `min`, doubling to `max`, with jitter (default
    /// 100 ms to 10 s: each wait is drawn from the upper half of its ceiling, so once a broker is
    /// back a relay at the cap finds it about 4 s later on average, 10 s at most; with a 30 s cap
    /// it was about 12 s, 30 s at most). It starts again from `min` only after a connection proved healthy (a
    /// PUBACK came, or it held for one keep-alive), never on CONNACK alone: a broker that accepts
    /// a connection and drops it at once is retried less and less often. The same wait applies
    /// after the broker answers "quota exceeded".
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// How long [`Relay::shutdown`](crate::Relay::shutdown) waits for in-flight PUBACKs (default 5 s). Unacknowledged
    /// messages stay in the outbox and are published again next time.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// How often applied command ids and retained sent rows past their retention are pruned and
    /// free pages returned to the file system (default 10 min). It runs in short slices whether
    /// or not the outbox is empty, so a device that never catches up is still cleaned.
    pub fn prune_interval(mut self, interval: Duration) -> Self {
        self.prune_interval = interval;
        self
    }

    /// How long the oldest message in flight may wait for its PUBACK while the connection stays
    /// up (default 60 s). Then the connection is renewed and the message published again, and
    /// the wait counts as a strike against it (see
    /// [`poison_disconnects`](Self::poison_disconnects)): some brokers neither acknowledge nor
    /// disconnect for a publish they will not take (RabbitMQ 3.10 above `max_message_size`).
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// Poison isolation: a message that was the oldest unacknowledged one on the wire when this
    /// many connections in a row ended (dropped by the broker, or renewed after the ack timeout)
    /// is moved to the dead letters with the cause, so the messages behind it flow (default 3;
    /// 0 never isolates). A DISCONNECT whose MQTT 5 reason code names the packet (packet too
    /// large, topic name invalid, not authorized, payload format invalid, malformed packet)
    /// counts as all of them at once; a broker that is busy, shutting down or quota-limited
    /// counts nothing. A single transient drop never dead-letters anything (unless this is 1).
    ///
    /// Per key, the messages behind an isolated one are published without it: the dead letter
    /// is the gap, and retrying it queues it again after them.
    pub fn poison_disconnects(mut self, n: u32) -> Self {
        self.poison_disconnects = n;
        self
    }

    /// Receive commands on this topic filter, in a second, persistent session (`clean_session =
    /// false`) whose client id is the main one plus `-commands`, unless set with
    /// [`commands_client_id`](Self::commands_client_id), or in the publishing session itself
    /// with [`single_session`](Self::single_session). [`Relay::start`](crate::Relay::start) checks the filter
    /// against MQTT's rules (`+` and `#` as whole levels, `#` last, no control characters, at
    /// most 65,535 bytes) and fails with [`Error::InvalidConfig`](crate::Error::InvalidConfig) naming the rule.
    pub fn commands(mut self, filter: impl Into<String>) -> Self {
        self.commands = Some(filter.into());
        self
    }

    /// Largest command delivery stored, in bytes of MQTT payload (default 64 KiB). A larger one is
    /// dead-lettered without its bytes (the reason gives its size) and acknowledged, and the
    /// session goes on. The payload inside a stored command is also held to
    /// [`Limits::max_payload_bytes`](crate::Limits::max_payload_bytes).
    pub fn max_command_bytes(mut self, bytes: usize) -> Self {
        self.max_command_bytes = bytes;
        self
    }

    /// Largest MQTT packet the command session reads at all (default 16 MiB), so that a delivery
    /// above [`max_command_bytes`](Self::max_command_bytes) can still be read, dead-lettered and
    /// acknowledged. A packet above this cannot be read: under MQTT 3.1.1 the broker cannot be
    /// told, and would deliver it again at every connection; under MQTT 5 it is the session's
    /// maximum packet size, and the broker drops a larger message for this client without the
    /// device seeing any trace of it (docs/security.md). Configure the broker to refuse larger
    /// messages on the command topics (mosquitto: `message_size_limit`).
    pub fn command_read_limit(mut self, bytes: usize) -> Self {
        self.command_read_limit = bytes;
        self
    }

    /// Store command deliveries that carry MQTT's retain flag (default false: acknowledge and
    /// ignore them, counted in [`Status::commands_retained_ignored`](crate::Status::commands_retained_ignored)). A broker sends a retained
    /// message again at every subscription, which the command session makes at every connection.
    /// When true, every command the session stores counts as its topic's retained command,
    /// whatever the flag of the delivery that brought it: a broker clears the flag on live
    /// deliveries, so one published retained while the device is subscribed looks like any
    /// other. Its id is kept past the inbox retention while it is the newest command on its
    /// topic, so a resent retained command is always recognised, never applied twice; an older
    /// one replaced by a newer one is pruned after the retention. Publish every command on such
    /// topics retained: a newer command published without the flag counts as the replacement,
    /// and the broker would still resend the older one after its id was pruned.
    pub fn retained_commands(mut self, store: bool) -> Self {
        self.retained_commands = store;
        self
    }

    /// How often the relay checks the database file for damage while it runs (default 1 h),
    /// within [`Options::integrity_check_budget`](crate::Options::integrity_check_budget). Damage
    /// is logged at ERROR and reported in [`Status::database_damaged`](crate::Status::database_damaged); the relay goes on with
    /// what it can read, and the next [`Outbox::open`](crate::Outbox::open) salvages the file
    /// ([`Options::salvage_on_corruption`](crate::Options::salvage_on_corruption)): restart the
    /// application (`edge-outbox relay` exits with code 1 for its supervisor to restart it).
    pub fn integrity_check_interval(mut self, interval: Duration) -> Self {
        self.integrity_interval = interval;
        self
    }

    /// Gives messages on topics matching `filter` a default lifetime: one still unpublished this
    /// long after its commit is removed instead of published (a gap notice, cause `expired`,
    /// tells the cloud), as [`Message::expires_after`](crate::Message::expires_after) does for one
    /// message; a message's own expiry wins. The first matching filter applies. Under MQTT 5 every
    /// message with a lifetime is published with the message expiry interval set to what is left
    /// of it, so the broker drops it too when it expires there.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let mqtt = edge_outbox::MqttConfig::new("127.0.0.1", 1883);
    /// let config = edge_outbox::RelayConfig::new(mqtt)
    ///     .expire_after("telemetry/#", Duration::from_secs(3600));
    /// ```
    pub fn expire_after(mut self, filter: impl Into<String>, lifetime: Duration) -> Self {
        self.ttl.push((filter.into(), lifetime));
        self
    }

    /// Paces publishing to at most `per_second` MQTT publishes a second (default: no limit), so
    /// that draining a long outage's backlog does not saturate a metered link; a batch
    /// ([`batch`](Self::batch)) is one publish. Higher priority lanes still go first. Bursts are
    /// limited to a tenth of a second's worth.
    ///
    /// ```
    /// let mqtt = edge_outbox::MqttConfig::new("127.0.0.1", 1883);
    /// let config = edge_outbox::RelayConfig::new(mqtt).pace_messages(50).pace_bytes(20_000);
    /// ```
    pub fn pace_messages(mut self, per_second: u32) -> Self {
        self.pace.messages = Some(per_second);
        self
    }

    /// Paces publishing to at most `per_second` bytes a second of MQTT payload and topic (default:
    /// no limit); see [`pace_messages`](Self::pace_messages). A message larger than a tenth of a
    /// second's worth still goes, once its time has been waited for.
    pub fn pace_bytes(mut self, per_second: u64) -> Self {
        self.pace.bytes = Some(per_second);
        self
    }

    /// Batch the messages whose topic matches `filter` (MQTT wildcards `+` and `#`): consecutive
    /// messages of one topic go out as one QoS 1 publish of up to
    /// [`Batching::max_bytes`], each still a complete envelope with its own id, sequence number
    /// and key (the wire form, envelope version 3, is in `docs/wire-format.md`; consumers unpack
    /// it with [`Published::decode_all`](crate::Published::decode_all)). The batch is
    /// acknowledged, marked, refused (every message dead-lettered with the reason) and published
    /// again after a reconnect as a whole. Called again, the first filter that matches a topic
    /// applies.
    ///
    /// Order: a batch holds only messages that are next to each other in commit order, so
    /// publishes leave in commit order exactly as without batching (a message of another topic
    /// in between ends the batch). After a connection died with messages in flight, the relay
    /// publishes one message at a time (see [`poison_disconnects`](Self::poison_disconnects)),
    /// batches included, so one bad message is still isolated alone.
    ///
    /// ```
    /// use edge_outbox::{Batching, Compression, MqttConfig, RelayConfig};
    ///
    /// let config = RelayConfig::new(MqttConfig::new("broker.local", 1883).client_id("pump-17"))
    ///     .batch("sensors/+/readings", Batching::new().compression(Compression::Zlib));
    /// # let _ = config;
    /// ```
    pub fn batch(mut self, filter: impl Into<String>, batching: Batching) -> Self {
        self.batching.push((filter.into(), batching));
        self
    }

    /// The command session's client id (not used in [single-session](Self::single_session)
    /// mode, where commands arrive on the main client id).
    pub fn commands_client_id(mut self, id: impl Into<String>) -> Self {
        self.commands_client_id = Some(id.into());
        self
    }

    /// One MQTT session per device: publishing and [`commands`](Self::commands) share one
    /// persistent session on the main client id, instead of a second session as
    /// `<id>-commands`. For brokers that take one connection per device identity (Azure IoT
    /// Hub) or whose policies pin the client id to the device (AWS IoT Core).
    ///
    /// Every guarantee holds as with two sessions: a row is marked sent only on its PUBACK, a
    /// command is acknowledged only once its inbox row commits, and after a reconnect
    /// publishing resumes at the oldest unacknowledged row. The session is persistent
    /// (`clean_session = false`, or a session that never expires under MQTT 5), so the broker
    /// queues commands while the device is offline. What changes: storing a command holds up
    /// the connection's other traffic for that moment (PUBACKs are read after it), and a
    /// connection lost for either reason is lost for both.
    ///
    /// ```
    /// use edge_outbox::{MqttConfig, RelayConfig};
    /// let config = RelayConfig::new(MqttConfig::new("broker.example", 8883).client_id("pump-17"))
    ///     .commands("devices/pump-17/commands/#")
    ///     .single_session(true);
    /// assert!(config.check().is_ok());
    /// ```
    pub fn single_session(mut self, on: bool) -> Self {
        self.single_session = on;
        self
    }

    /// Follow `profile`'s cloud: its connection settings ([`MqttConfig::cloud`], unless the
    /// broker settings have them already), one session per device
    /// ([`single_session`](Self::single_session)), and its in-flight cap where it has one. Those
    /// are settings, and a later call replaces each. Its rules are checked, here and by the relay:
    /// [`check`](Self::check) refuses a status topic or schema topic on a cloud that keeps no
    /// retained messages (Azure IoT Hub), a status, schema topic or command filter the cloud's
    /// topic rules refuse, and an in-flight window above the cloud's cap; the relay dead-letters
    /// a row whose topic breaks the cloud's topic rules (written by a process without
    /// [`Limits::cloud`](crate::Limits::cloud), or with another profile or device id), with the
    /// rule as the reason.
    ///
    /// ```
    /// use edge_outbox::{CloudProfile, MqttConfig, RelayConfig};
    /// let config = RelayConfig::new(MqttConfig::new("my-hub.azure-devices.net", 8883).client_id("pump-17"))
    ///     .cloud(CloudProfile::AzureIotHub)
    ///     .commands("devices/pump-17/messages/devicebound/#");
    /// assert!(config.is_single_session() && config.check().is_ok());
    /// let refused = RelayConfig::new(
    ///     MqttConfig::new("my-hub.azure-devices.net", 8883).client_id("pump-17").status_topic("pumps/17/status"),
    /// )
    /// .cloud(CloudProfile::AzureIotHub)
    /// .check();
    /// assert!(refused.unwrap_err().to_string().contains("retained"));
    /// ```
    pub fn cloud(mut self, profile: crate::CloudProfile) -> Self {
        if self.mqtt.cloud_profile() != Some(profile) {
            self.mqtt = self.mqtt.cloud(profile);
        }
        self.cloud = Some(profile);
        self.single_session = true;
        self.routing_fields = true;
        if let Some(cap) = profile.max_in_flight() {
            self.max_in_flight = self.max_in_flight.min(cap);
        }
        self
    }

    /// Repeat each message's routing fields outside its payload, where a cloud's rules engine
    /// reads them without decoding CBOR: `id` (the UUID in text), `src`, `ep`, `seq`, `key`
    /// and `type` (when the message has one), with the content type (`application/cbor`, or
    /// `application/json` with [`envelope_format`](Self::envelope_format) JSON). A gap notice
    /// carries `id`, `src`, `ep`, `gap` (`first-last`) and `cause`; a batch `src`, `ep`, `seq`
    /// (`first-last`) and `n` (its members' own fields are inside it).
    ///
    /// Under MQTT 5 they are user properties, and the content type the Content Type property
    /// (AWS IoT rules read them with `get_user_property` and `get_mqtt_property`; Event Grid
    /// routes on them). With the Azure IoT Hub profile they go in the property bag at the end
    /// of the topic (`devices/{id}/messages/events/%24.ct=application%2Fcbor&id=...`),
    /// URL-encoded, where IoT Hub message routing reads them as application properties (each
    /// message then has a topic of its own, so none are batched together). Under MQTT 3.1.1
    /// elsewhere there is nowhere to put them: [`check`](Self::check) refuses the setting.
    /// Every cloud profile turns them on; a later `routing_fields(false)` turns them off.
    ///
    /// The payload is unchanged: the fields are a copy, they count towards the packet size
    /// limit, and a consumer that decodes the envelope needs none of them.
    ///
    /// ```
    /// use edge_outbox::{MqttConfig, Protocol, RelayConfig};
    /// let v5 = MqttConfig::new("broker.example", 8883).client_id("pump-17").protocol(Protocol::V5);
    /// assert!(RelayConfig::new(v5).routing_fields(true).check().is_ok());
    /// let v311 = MqttConfig::new("broker.example", 8883).client_id("pump-17").protocol(Protocol::V311);
    /// assert!(RelayConfig::new(v311).routing_fields(true).check().is_err());
    /// ```
    pub fn routing_fields(mut self, on: bool) -> Self {
        self.routing_fields = on;
        self
    }

    /// Publish envelopes in `format`: CBOR (the default) or JSON with the same fields, for a
    /// cloud whose rules read JSON bodies (AWS IoT rules, IoT Hub message routing on the body,
    /// Event Grid). See [`EnvelopeFormat`](crate::envelope::EnvelopeFormat) for the payloads JSON cannot
    /// carry; a batch of JSON envelopes is a JSON object too, and cannot be compressed
    /// ([`check`](Self::check) refuses zlib with JSON). Under MQTT 5 a JSON publish says so: the
    /// Content Type `application/json` and the payload format indicator (UTF-8). Every decoder of
    /// this crate reads both formats.
    ///
    /// ```
    /// use edge_outbox::{EnvelopeFormat, MqttConfig, RelayConfig};
    /// let config = RelayConfig::new(MqttConfig::new("broker.example", 8883).client_id("pump-17"))
    ///     .envelope_format(EnvelopeFormat::Json);
    /// assert!(config.check().is_ok());
    /// ```
    pub fn envelope_format(mut self, format: crate::envelope::EnvelopeFormat) -> Self {
        self.format = format;
        self
    }

    /// The envelope format (see [`envelope_format`](Self::envelope_format)).
    pub fn format(&self) -> crate::envelope::EnvelopeFormat {
        self.format
    }

    /// Whether publishes carry routing fields (see [`routing_fields`](Self::routing_fields)).
    pub fn has_routing_fields(&self) -> bool {
        self.routing_fields
    }

    /// Where the routing fields go, if they are sent and there is a place for them.
    pub(crate) fn routing_placement(&self) -> Option<crate::routing_fields::Placement> {
        use crate::routing_fields::Placement;
        if !self.routing_fields {
            return None;
        }
        if self.cloud == Some(crate::CloudProfile::AzureIotHub) {
            return Some(Placement::PropertyBag);
        }
        (self.mqtt.version() == crate::mqtt::Protocol::V5).then_some(Placement::UserProperties)
    }

    /// The cloud profile set with [`cloud`](Self::cloud), if any.
    pub fn cloud_profile(&self) -> Option<crate::CloudProfile> {
        self.cloud
    }

    /// Whether publishing and commands share one session (see
    /// [`single_session`](Self::single_session)).
    pub fn is_single_session(&self) -> bool {
        self.single_session
    }

    /// Whether the publishing connection carries commands too: one session asked for, and a
    /// command topic to subscribe to.
    pub(crate) fn shares_session(&self) -> bool {
        self.single_session && self.commands.is_some()
    }

    /// The broker settings.
    pub fn mqtt(&self) -> &MqttConfig {
        &self.mqtt
    }

    /// The envelopes' `src`.
    pub fn source_name(&self) -> &str {
        &self.source
    }

    /// Checks these settings as [`Relay::start`](crate::Relay::start) will, without starting
    /// anything: a configuration refused here is refused there, with the same error. For a
    /// tool that checks settings before applying them (`edge-outbox config check`, a reload).
    ///
    /// ```
    /// use edge_outbox::{MqttConfig, RelayConfig};
    /// assert!(RelayConfig::new(MqttConfig::new("broker.example", 1883)).check().is_ok());
    /// assert!(RelayConfig::new(MqttConfig::new("broker.example", 1883)).max_in_flight(0).check().is_err());
    /// ```
    pub fn check(&self) -> Result<()> {
        self.validate()?;
        self.mqtt.validate(self.mqtt.id())?;
        if self.commands.is_some() {
            self.mqtt.validate(&self.commands_client())?;
        }
        Ok(())
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.max_in_flight == 0 || self.max_in_flight > usize::from(u16::MAX) {
            return Err(Error::InvalidConfig(
                "max_in_flight must be from 1 to 65535".into(),
            ));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::InvalidConfig("poll_interval must be above zero".into()));
        }
        if self.ack_timeout.is_zero() {
            return Err(Error::InvalidConfig("ack_timeout must be above zero".into()));
        }
        if self.single_session && self.commands_client_id.is_some() {
            return Err(Error::InvalidConfig(
                "commands_client_id with single-session mode: commands arrive on the main client \
                 id, so a command session's id has nothing to name"
                    .into(),
            ));
        }
        if let Some(filter) = &self.commands {
            validate_filter(filter)?;
            if self.mqtt.sas().is_some() && !self.single_session {
                return Err(Error::InvalidConfig(
                    "commands with a SAS key need single-session mode: Azure IoT Hub takes one \
                     connection per device id, and a separate command session would be a second \
                     one (set single_session, or --single-session)"
                        .into(),
                ));
            }
        }
        for (filter, _) in &self.ttl {
            validate_filter(filter)?;
        }
        if let Some(cloud) = self.cloud {
            self.validate_cloud(cloud)?;
        }
        if self.routing_fields && self.routing_placement().is_none() {
            return Err(Error::InvalidConfig(
                "routing fields need somewhere to go: MQTT 5 (user properties) or the Azure IoT \
                 Hub profile (its property bag); MQTT 3.1.1 has neither"
                    .into(),
            ));
        }
        #[cfg(feature = "schemas")]
        if let Some(topic) = &self.schema_topic {
            crate::topic::check(topic, false)?;
        }
        if self.metrics_file_mode & !0o644 != 0 || self.metrics_file_mode & 0o600 != 0o600 {
            return Err(Error::InvalidConfig(format!(
                "metrics_file_mode {:o}: the owner must read and write the file, and nobody else \
                 write or execute it (at most 644)",
                self.metrics_file_mode
            )));
        }
        if self.pace.messages == Some(0) || self.pace.bytes == Some(0) {
            return Err(Error::InvalidConfig(
                "a pace of 0 would never publish: pace_messages and pace_bytes must be at least 1".into(),
            ));
        }
        for (filter, batching) in &self.batching {
            validate_filter(filter)?;
            batching.validate()?;
            if self.format == crate::envelope::EnvelopeFormat::Json
                && batching.compression == crate::batching::Compression::Zlib
            {
                return Err(Error::InvalidConfig(format!(
                    "batches of {filter}: zlib makes a batch binary, and a JSON envelope is text; \
                     batch JSON envelopes without compression"
                )));
            }
        }
        if self.max_command_bytes == 0 {
            return Err(Error::InvalidConfig(
                "max_command_bytes must be at least 1".into(),
            ));
        }
        if self.command_read_limit < self.max_command_bytes {
            return Err(Error::InvalidConfig(format!(
                "command_read_limit ({} bytes) is below max_command_bytes ({} bytes): an oversized \
                 command could not be read to be dead-lettered",
                self.command_read_limit, self.max_command_bytes
            )));
        }
        Ok(())
    }

    /// The cloud's rules that settings alone can break.
    fn validate_cloud(&self, cloud: crate::CloudProfile) -> Result<()> {
        if let Some(cap) = cloud.max_in_flight()
            && self.max_in_flight > cap
        {
            return Err(Error::InvalidConfig(format!(
                "max_in_flight {} is above {}'s limit of {cap} unacknowledged messages per client",
                self.max_in_flight,
                cloud.cloud()
            )));
        }
        #[cfg(feature = "schemas")]
        let schema_topic = self.schema_topic.is_some();
        #[cfg(not(feature = "schemas"))]
        let schema_topic = false;
        if !cloud.retains() && (self.mqtt.status().is_some() || schema_topic) {
            return Err(Error::InvalidConfig(format!(
                "{} keeps no retained messages, which the status topic and the schema topic are: \
                 leave them unset with profile {cloud}",
                cloud.cloud()
            )));
        }
        let rules = cloud.topic_rules(self.mqtt.id());
        if let Some(topic) = self.mqtt.status() {
            rules.check(topic)?;
        }
        #[cfg(feature = "schemas")]
        if let Some(topic) = &self.schema_topic {
            rules.check(topic)?;
        }
        if let Some(filter) = &self.commands {
            rules.check_commands_filter(filter)?;
        }
        Ok(())
    }

    /// The client id commands arrive on: the main one in single-session mode.
    pub(crate) fn commands_client(&self) -> String {
        if self.single_session {
            return self.mqtt.id().to_owned();
        }
        self.commands_client_id
            .clone()
            .unwrap_or_else(|| format!("{}-commands", self.mqtt.id()))
    }
}
