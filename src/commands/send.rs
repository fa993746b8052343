//! The other end of a command: publishing one to a device from the cloud side (a Rust service,
//! an operator's `edge-outbox send-command`), at QoS 1, waiting for the broker's PUBACK.

use std::time::{Duration, Instant};

use rumqttc::QoS;

use crate::envelope::Envelope;
use crate::error::{Error, Result};
use crate::mqtt::Recv;
use crate::mqtt::event::{Event, Step, Verdict};
use crate::mqtt::{MqttConfig, Role, SessionOptions};

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
    crate::topic::check(topic, false)?;
    let bytes = command.encode();
    if bytes.len() + topic.len() + 16 > mqtt.packet_limit() {
        return Err(Error::PayloadTooLarge {
            size: bytes.len(),
            max: mqtt.packet_limit().saturating_sub(topic.len() + 16),
        });
    }
    let broker = mqtt.endpoint();
    let failed = |kind: std::io::ErrorKind, why: String| {
        Error::io(
            format!("sending command {} to {broker}", command.id),
            std::io::Error::new(kind, why),
        )
    };
    // The same client options the relay uses (protocol, TLS, credentials), as a one-shot
    // publisher with a clean session.
    let options = SessionOptions::new(mqtt, mqtt.id(), Role::Publisher { max_in_flight: 1 })?;
    let opened = options
        .open(0)
        .map_err(|cause| failed(std::io::ErrorKind::Other, cause.to_string()))?;
    let (client, mut connection) = (opened.client, opened.connection);
    client
        .try_publish(
            topic,
            QoS::AtLeastOnce,
            false,
            bytes,
            crate::mqtt::Extra::default(),
        )
        .map_err(|_| failed(std::io::ErrorKind::Other, "could not queue the publish".into()))?;
    let deadline = Instant::now() + timeout;
    let mut connected = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(failed(
                std::io::ErrorKind::TimedOut,
                format!("no acknowledgement within {timeout:?}; send it again with the same id"),
            ));
        }
        // A connect is bounded by the configured connect timeout, not by `left`: a timeout
        // abandons a connect in progress.
        match connection.recv(connected, connected.then_some(left)) {
            Recv::Step(Step::ConnAck(_)) => connected = true,
            // The only publish on this connection: this is its acknowledgement.
            Recv::Step(Step::Event(Event::PubAck(ack, _))) => {
                let _ = client.try_disconnect();
                // Let the DISCONNECT go out; the connection ends either way.
                let _ = connection.recv(true, Some(Duration::from_millis(100)));
                return match ack.verdict {
                    Verdict::Accepted => Ok(()),
                    Verdict::Refused(reason) => Err(failed(
                        std::io::ErrorKind::PermissionDenied,
                        format!("the broker refused the command: {reason}"),
                    )),
                    Verdict::Later(reason) => Err(failed(
                        std::io::ErrorKind::WouldBlock,
                        format!(
                            "the broker cannot take the command now ({reason}); send it again with the same id"
                        ),
                    )),
                };
            }
            Recv::Step(_) | Recv::Idle => {}
            Recv::Failed(cause) => {
                return Err(failed(std::io::ErrorKind::ConnectionRefused, cause.to_string()));
            }
            Recv::Closed => return Err(failed(std::io::ErrorKind::Other, "the connection closed".into())),
        }
    }
}
