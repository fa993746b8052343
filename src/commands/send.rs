//! The other end of a command: publishing one to a device from the cloud side (a Rust service,
//! an operator's `edge-outbox send-command`), at QoS 1, waiting for the broker's PUBACK.

use std::time::{Duration, Instant};

use rumqttc::{Client, ConnectReturnCode, Event, Packet, QoS};

use crate::envelope::Envelope;
use crate::error::{Error, Result};
use crate::mqtt::MqttConfig;
use crate::store::outbox::is_topic_name;

/// Publishes `command` on `topic` at QoS 1 through the broker in `mqtt` (a fresh, clean session
/// with `mqtt`'s client id: give the sender its own, never a device's), and returns once the
/// broker has acknowledged it, or fails after `timeout`.
///
/// A PUBACK means the broker has the command; the device gets it when its command session is
/// connected (its persistent session queues it meanwhile). After an error or a timeout the
/// command may or may not have reached the broker: send it again **with the same id** (keep the
/// [`Envelope`]): the device's inbox applies an id once, so a resend is never applied twice.
///
/// ```no_run
/// use std::time::Duration;
/// use edge_outbox::{Envelope, MessageId, MqttConfig, send_command};
///
/// let command = Envelope::command(MessageId::new_v7(), "pump-17", &("set_rate", 12.5))?;
/// let broker = MqttConfig::from_url("mqtt://broker.example:1883")?.client_id("ops-console-1");
/// send_command(&broker, "devices/pump-17/commands/rate", &command, Duration::from_secs(10))?;
/// # Ok::<(), edge_outbox::Error>(())
/// ```
pub fn send_command(mqtt: &MqttConfig, topic: &str, command: &Envelope<'_>, timeout: Duration) -> Result<()> {
    if !is_topic_name(topic) {
        return Err(Error::InvalidTopic(topic.to_owned()));
    }
    let bytes = command.encode();
    if bytes.len() + topic.len() + 16 > mqtt.packet_limit() {
        return Err(Error::PayloadTooLarge {
            size: bytes.len(),
            max: mqtt.packet_limit().saturating_sub(topic.len() + 16),
        });
    }
    let broker = format!("{}:{}", mqtt.host(), mqtt.port());
    let failed = |kind: std::io::ErrorKind, why: String| {
        Error::io(
            format!("sending command {} to {broker}", command.id),
            std::io::Error::new(kind, why),
        )
    };
    let (client, mut connection) = Client::new(mqtt.to_rumqttc(mqtt.id(), true)?, 4);
    client
        .try_publish(topic, QoS::AtLeastOnce, false, bytes)
        .map_err(|e| failed(std::io::ErrorKind::Other, e.to_string()))?;
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match connection.recv_timeout(left) {
            Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) if ack.code != ConnectReturnCode::Success => {
                return Err(failed(
                    std::io::ErrorKind::PermissionDenied,
                    format!("the broker refused the connection: {:?}", ack.code),
                ));
            }
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => {
                // The only publish on this connection: this is its acknowledgement.
                let _ = client.try_disconnect();
                // Let the DISCONNECT go out; the connection ends either way.
                let _ = connection.recv_timeout(Duration::from_millis(100));
                return Ok(());
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(failed(std::io::ErrorKind::ConnectionRefused, e.to_string())),
            Err(_) => {
                return Err(failed(
                    std::io::ErrorKind::TimedOut,
                    format!("no acknowledgement within {timeout:?}; send it again with the same id"),
                ));
            }
        }
    }
}
