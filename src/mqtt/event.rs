//! One event type for both protocol versions: what the relay and the command session act on,
//! translated from rumqttc's v4 (MQTT 3.1.1) and v5 events.

use std::fmt;
use std::time::Instant;

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5 as v5p;

use super::config::Protocol;

/// One thing rumqttc reported: a CONNACK (a new connection) or an event on the current one.
#[derive(Debug)]
pub(crate) enum Step {
    ConnAck(Granted),
    Event(Event),
}

/// What a session sees on its connection, in order.
#[derive(Debug)]
pub(crate) enum Event {
    /// An outgoing PUBLISH was written with this packet id (0 for QoS 0), at this time (read on
    /// the connection's thread: whoever handles the event may get it later, see
    /// `crate::relay`'s forwarder).
    Published(u16, Instant),
    /// Packet-id collision: the next publish waits for this id's PUBACK (rumqttc sends it later,
    /// reported by a `Published` with the same id).
    AwaitAck(u16),
    /// A PUBACK for one of our publishes, and when the connection's thread handed it out: on the
    /// same clock, and in the same order, as a `Published`'s time.
    PubAck(PubAck, Instant),
    /// A message delivered to us (the command session).
    Delivery(Box<Delivery>),
    /// The answer to a SUBSCRIBE: one result per filter.
    SubAck(Vec<SubResult>),
    /// Our PUBACK for a delivery with this packet id was written.
    AckSent(u16),
    /// We sent DISCONNECT: the session is over.
    DisconnectSent,
    /// A keep-alive answer or another packet the sessions do not act on.
    Other,
}

/// What CONNACK said, and what it granted (MQTT 5 properties; all `None` under 3.1.1).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Granted {
    pub session_present: bool,
    /// The broker's maximum packet size: larger packets must not be sent.
    pub max_packet_size: Option<u32>,
    /// The broker's receive maximum: at most this many QoS 1 publishes unacknowledged.
    pub receive_max: Option<u16>,
    /// How many topic aliases the broker accepts from us.
    pub topic_alias_max: Option<u16>,
    /// The keep-alive the broker imposes (rumqttc uses it).
    pub server_keep_alive: Option<u16>,
}

/// A PUBACK: its packet id and what the broker said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PubAck {
    pub pkid: u16,
    pub verdict: Verdict,
}

/// What a PUBACK's reason code means for the row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Success or "no matching subscribers" (MQTT 5 0x00, 0x10; every 3.1.1 PUBACK): mark it.
    Accepted,
    /// The broker refused the message for good (not authorized, topic name invalid, payload
    /// format invalid, packet too large, implementation specific, unspecified): dead-letter it.
    Refused(Reason),
    /// The broker cannot take it now (quota exceeded): publish it again later.
    Later(Reason),
}

/// An MQTT 5 reason code with its name and the broker's reason string, if it sent one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reason {
    pub code: u8,
    pub string: Option<String>,
}

impl Reason {
    pub(crate) fn new(code: u8, string: Option<String>) -> Self {
        Reason { code, string }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0x{:02X} {}", self.code, reason_name(self.code))?;
        if let Some(s) = self.string.as_deref().filter(|s| !s.is_empty()) {
            write!(f, " ({s:?})")?;
        }
        Ok(())
    }
}

/// The name MQTT 5 gives a reason code (PUBACK, SUBACK and DISCONNECT codes share numbers).
pub(crate) fn reason_name(code: u8) -> &'static str {
    match code {
        0x00 => "success",
        0x10 => "no matching subscribers",
        0x80 => "unspecified error",
        0x81 => "malformed packet",
        0x82 => "protocol error",
        0x83 => "implementation specific error",
        0x87 => "not authorized",
        0x89 => "server busy",
        0x8B => "server shutting down",
        0x8D => "keep alive timeout",
        0x8E => "session taken over",
        0x8F => "topic filter invalid",
        0x90 => "topic name invalid",
        0x91 => "packet identifier in use",
        0x93 => "receive maximum exceeded",
        0x94 => "topic alias invalid",
        0x95 => "packet too large",
        0x96 => "message rate too high",
        0x97 => "quota exceeded",
        0x98 => "administrative action",
        0x99 => "payload format invalid",
        0x9A => "retain not supported",
        0x9B => "QoS not supported",
        0x9C => "use another server",
        0x9D => "server moved",
        0x9E => "shared subscriptions not supported",
        0x9F => "connection rate exceeded",
        0xA1 => "subscription identifiers not supported",
        0xA2 => "wildcard subscriptions not supported",
        _ => "unknown reason code",
    }
}

/// A PUBACK reason code sorted into what the relay does with the row.
pub(crate) fn verdict(reason: Reason) -> Verdict {
    match reason.code {
        0x00 | 0x10 => Verdict::Accepted,
        // Quota exceeded: a rate or volume limit that lifts. Packet identifier in use is a
        // protocol hiccup, not the message's fault.
        0x97 | 0x91 => Verdict::Later(reason),
        _ => Verdict::Refused(reason),
    }
}

/// One filter's SUBACK result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SubResult {
    Granted,
    /// Refused; the MQTT 5 reason code (0x80 for a 3.1.1 failure).
    Refused(u8),
}

/// A message delivered to the command session. Acknowledge it with
/// [`MqttClient::try_ack`](super::client::MqttClient::try_ack).
#[derive(Debug, Clone)]
pub(crate) struct Delivery {
    pub topic: String,
    pub payload: Bytes,
    /// The broker sends it because it was retained (again at every subscription).
    pub retain: bool,
    pub(crate) raw: RawPublish,
}

impl Delivery {
    /// Its packet id (0 for QoS 0).
    pub(crate) fn pkid(&self) -> u16 {
        match &self.raw {
            RawPublish::V4(p) => p.pkid,
            RawPublish::V5(p) => p.pkid,
        }
    }
}

/// The packet as rumqttc gave it: acknowledging needs it back.
#[derive(Debug, Clone)]
pub(crate) enum RawPublish {
    V4(rumqttc::Publish),
    V5(v5p::Publish),
}

/// Why a connection ended (or never started), for logs, status and the relay's decisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cause {
    /// One line for operators. Never holds credentials.
    pub text: String,
    pub kind: CauseKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CauseKind {
    /// The connection never got a CONNACK (network, TLS, refused, timeout).
    Connect,
    /// The broker closed the connection for a reason that names a packet we sent (packet too
    /// large, topic name invalid, ...): the oldest unacknowledged message is the suspect.
    NamesPacket,
    /// The broker's own state (busy, quota, shutting down, session taken over): nothing the
    /// messages in flight did.
    Broker,
    /// The connection was lost (I/O, keep-alive) without a reason.
    Lost,
    /// This side ended it because the oldest message got no answer (no PUBACK within the ack
    /// timeout, or a packet-id collision the broker never resolved): counts against it.
    Requested,
    /// This side ended it to publish again later (quota exceeded), or to get out of a state
    /// rumqttc cannot leave on its own: not the message's fault.
    Retry,
    /// This side replaced it, healthy, because its credentials expire soon: planned, no error.
    Renew,
}

impl Cause {
    pub(crate) fn new(kind: CauseKind, text: impl Into<String>) -> Self {
        Cause {
            text: text.into(),
            kind,
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Translates a rumqttc 3.1.1 event.
pub(crate) fn from_v4(event: rumqttc::Event) -> Step {
    use rumqttc::{Event as E, Outgoing as O, Packet as P, SubscribeReasonCode as S};
    Step::Event(match event {
        E::Incoming(P::ConnAck(ack)) => {
            return Step::ConnAck(Granted {
                session_present: ack.session_present,
                ..Granted::default()
            });
        }
        E::Incoming(P::PubAck(ack)) => Event::PubAck(
            PubAck {
                pkid: ack.pkid,
                verdict: Verdict::Accepted,
            },
            Instant::now(),
        ),
        E::Incoming(P::Publish(p)) => Event::Delivery(Box::new(Delivery {
            topic: p.topic.clone(),
            payload: p.payload.clone(),
            retain: p.retain,
            raw: RawPublish::V4(p),
        })),
        E::Incoming(P::SubAck(ack)) => Event::SubAck(
            ack.return_codes
                .iter()
                .map(|c| match c {
                    S::Success(_) => SubResult::Granted,
                    S::Failure => SubResult::Refused(0x80),
                })
                .collect(),
        ),
        E::Outgoing(O::Publish(pkid)) => Event::Published(pkid, Instant::now()),
        E::Outgoing(O::AwaitAck(pkid)) => Event::AwaitAck(pkid),
        E::Outgoing(O::PubAck(pkid)) => Event::AckSent(pkid),
        E::Outgoing(O::Disconnect) => Event::DisconnectSent,
        _ => Event::Other,
    })
}

/// Translates a rumqttc MQTT 5 event.
pub(crate) fn from_v5(event: rumqttc::v5::Event) -> Step {
    use rumqttc::Outgoing as O;
    use rumqttc::v5::Event as E;
    use v5p::Packet as P;
    Step::Event(match event {
        E::Incoming(P::ConnAck(ack)) => {
            let props = ack.properties.as_ref();
            return Step::ConnAck(Granted {
                session_present: ack.session_present,
                max_packet_size: props.and_then(|p| p.max_packet_size),
                receive_max: props.and_then(|p| p.receive_max),
                topic_alias_max: props.and_then(|p| p.topic_alias_max),
                server_keep_alive: props.and_then(|p| p.server_keep_alive),
            });
        }
        E::Incoming(P::PubAck(ack)) => Event::PubAck(
            PubAck {
                pkid: ack.pkid,
                verdict: verdict(Reason::new(
                    puback_code(ack.reason),
                    ack.properties.and_then(|p| p.reason_string),
                )),
            },
            Instant::now(),
        ),
        E::Incoming(P::Publish(p)) => Event::Delivery(Box::new(Delivery {
            topic: String::from_utf8_lossy(&p.topic).into_owned(),
            payload: p.payload.clone(),
            retain: p.retain,
            raw: RawPublish::V5(p),
        })),
        E::Incoming(P::SubAck(ack)) => Event::SubAck(
            ack.return_codes
                .iter()
                .map(|c| match c {
                    v5p::SubscribeReasonCode::Success(_) => SubResult::Granted,
                    other => SubResult::Refused(suback_code(*other)),
                })
                .collect(),
        ),
        E::Outgoing(O::Publish(pkid)) => Event::Published(pkid, Instant::now()),
        E::Outgoing(O::AwaitAck(pkid)) => Event::AwaitAck(pkid),
        E::Outgoing(O::PubAck(pkid)) => Event::AckSent(pkid),
        E::Outgoing(O::Disconnect) => Event::DisconnectSent,
        _ => Event::Other,
    })
}

fn puback_code(reason: v5p::PubAckReason) -> u8 {
    use v5p::PubAckReason as R;
    match reason {
        R::Success => 0x00,
        R::NoMatchingSubscribers => 0x10,
        R::UnspecifiedError => 0x80,
        R::ImplementationSpecificError => 0x83,
        R::NotAuthorized => 0x87,
        R::TopicNameInvalid => 0x90,
        R::PacketIdentifierInUse => 0x91,
        R::QuotaExceeded => 0x97,
        R::PayloadFormatInvalid => 0x99,
    }
}

fn suback_code(reason: v5p::SubscribeReasonCode) -> u8 {
    use v5p::SubscribeReasonCode as R;
    match reason {
        R::Success(qos) => qos as u8,
        R::Failure | R::Unspecified => 0x80,
        R::ImplementationSpecific => 0x83,
        R::NotAuthorized => 0x87,
        R::TopicFilterInvalid => 0x8F,
        R::PkidInUse => 0x91,
        R::QuotaExceeded => 0x97,
        R::SharedSubscriptionsNotSupported => 0x9E,
        R::SubscriptionIdNotSupported => 0xA1,
        R::WildcardSubscriptionsNotSupported => 0xA2,
    }
}

/// Describes a rumqttc 3.1.1 connection error. `connected`: a CONNACK was seen on this
/// connection.
pub(crate) fn cause_v4(e: &rumqttc::ConnectionError, connected: bool) -> Cause {
    use rumqttc::{ConnectionError as C, StateError as S};
    let kind = if connected {
        CauseKind::Lost
    } else {
        CauseKind::Connect
    };
    match e {
        C::Io(io) => Cause::new(kind, io_text(io, connected)),
        C::ConnectionRefused(code) => Cause::new(
            CauseKind::Connect,
            format!("the broker refused the connection: {code:?}"),
        ),
        C::NetworkTimeout => Cause::new(CauseKind::Connect, "connection attempt timed out"),
        C::FlushTimeout => Cause::new(kind, "timed out writing to the broker"),
        C::MqttState(S::CollisionTimeout) => Cause::new(
            CauseKind::Requested,
            "a packet-id collision was not resolved (the broker acknowledged out of order and \
             never acknowledged the colliding id)",
        ),
        C::MqttState(S::AwaitPingResp) => Cause::new(kind, "keep-alive timeout: no PINGRESP from the broker"),
        C::MqttState(S::Io(io)) => Cause::new(kind, io_text(io, connected)),
        other => Cause::new(kind, other.to_string()),
    }
}

/// Describes a rumqttc MQTT 5 connection error; see [`cause_v4`].
pub(crate) fn cause_v5(e: &rumqttc::v5::ConnectionError, connected: bool) -> Cause {
    use rumqttc::v5::mqttbytes::Error as M;
    use rumqttc::v5::{ConnectionError as C, StateError as S};
    let kind = if connected {
        CauseKind::Lost
    } else {
        CauseKind::Connect
    };
    let not_v5 = |what: String| {
        Cause::new(
            CauseKind::Connect,
            format!(
                "{what}: if this broker does not speak MQTT 5, connect with MQTT 3.1.1 \
                 (MqttConfig::protocol(Protocol::V311), or --mqtt-version 3.1.1)"
            ),
        )
    };
    match e {
        C::Io(io) if !connected && broken_pipe(io) => not_v5(format!(
            "the broker closed the connection before answering CONNECT ({io})"
        )),
        C::MqttState(S::ConnectionAborted) if !connected => {
            not_v5("the broker closed the connection before answering CONNECT".into())
        }
        C::MqttState(S::Deserialization(m)) if !connected => {
            not_v5(format!("the broker's answer to CONNECT is not MQTT 5 ({m})"))
        }
        C::NotConnAck(packet) => not_v5(format!("the broker answered CONNECT with {packet:?}")),
        C::Io(io) => Cause::new(kind, io_text(io, connected)),
        C::ConnectionRefused(code) => Cause::new(
            CauseKind::Connect,
            format!("the broker refused the connection: {code:?}"),
        ),
        C::Timeout(_) => Cause::new(CauseKind::Connect, "connection attempt timed out"),
        C::MqttState(S::ServerDisconnect {
            reason_code,
            reason_string,
        }) => {
            let reason = Reason::new(*reason_code as u8, reason_string.clone());
            Cause::new(
                disconnect_kind(reason.code),
                format!("the broker disconnected: {reason}"),
            )
        }
        // mosquitto answers a publish above its message_size_limit with PUBACK 0x95, a code
        // MQTT 5 does not allow in a PUBACK and rumqttc cannot parse: the connection fails on it.
        C::MqttState(S::Deserialization(M::InvalidConnectReturnCode(code))) if connected => {
            let reason = Reason::new(*code, None);
            Cause::new(
                CauseKind::NamesPacket,
                format!(
                    "the broker refused a message with reason {reason} (in a packet rumqttc cannot parse)"
                ),
            )
        }
        C::MqttState(S::CollisionTimeout) => Cause::new(
            CauseKind::Requested,
            "a packet-id collision was not resolved (the broker acknowledged out of order and \
             never acknowledged the colliding id)",
        ),
        C::MqttState(S::AwaitPingResp) => Cause::new(kind, "keep-alive timeout: no PINGRESP from the broker"),
        C::MqttState(S::ConnectionAborted) => Cause::new(kind, "the broker closed the connection"),
        C::MqttState(S::Io(io)) => Cause::new(kind, io_text(io, connected)),
        other => Cause::new(kind, other.to_string()),
    }
}

/// How a DISCONNECT reason code bears on the messages in flight.
fn disconnect_kind(code: u8) -> CauseKind {
    match code {
        // Reasons about a packet we sent: the oldest unacknowledged message is the suspect.
        0x81 | 0x87 | 0x90 | 0x95 | 0x99 => CauseKind::NamesPacket,
        // The broker's load or administration, or another client: not the message's fault.
        0x89 | 0x8B | 0x8E | 0x93 | 0x96 | 0x97 | 0x98 | 0x9C | 0x9D | 0x9F => CauseKind::Broker,
        _ => CauseKind::Lost,
    }
}

fn broken_pipe(io: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        io.kind(),
        K::ConnectionReset | K::UnexpectedEof | K::BrokenPipe | K::ConnectionAborted
    )
}

fn io_text(io: &std::io::Error, connected: bool) -> String {
    if connected {
        format!("connection lost: {io}")
    } else {
        format!("cannot connect: {io}")
    }
}

/// What an operator must know about connecting with `protocol`: the warning logged on each
/// connection made with MQTT 3.1.1.
pub(crate) fn protocol_note(protocol: Protocol) -> Option<&'static str> {
    match protocol {
        Protocol::V5 => None,
        Protocol::V311 => Some(
            "MQTT 3.1.1: the broker cannot refuse a publish; a message its ACL denies or that is \
             above its size limit is acknowledged and lost (see docs/reliability.md)",
        ),
    }
}
