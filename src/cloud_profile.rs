//! Cloud profiles: the settings and the documented limits of the managed MQTT endpoints field
//! devices connect to, as a user would otherwise set them by hand. A profile's settings are
//! ordinary settings, applied by [`RelayConfig::cloud`](crate::RelayConfig::cloud) and
//! overridden by any later call; its limits are checked where messages are written
//! ([`Limits::cloud`](crate::Limits::cloud)) and again by the relay, so a message the cloud would
//! refuse is refused with the limit's name instead of being learnt from a failed publish.
//! docs/operations.md cites each cloud's documentation for every figure here.
//!
//! A leaf: the settings that are MQTT's own (the profile's protocol version) are given where
//! MQTT's settings live, `crate::mqtt`, so that module and the store can both use this one.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// A managed MQTT endpoint whose rules the relay and the write path follow.
///
/// ```
/// use edge_outbox::{CloudProfile, Limits, MqttConfig, Options, RelayConfig};
///
/// let profile: CloudProfile = "aws-iot-core".parse()?;
/// // Where events are written: AWS's payload, topic length and depth limits, `$aws/` reserved.
/// let options = Options::new().limits(Limits::new().cloud(profile, "pump-17"));
/// // The relay: MQTT 5, one session per device, at most 100 messages in flight.
/// let config = RelayConfig::new(MqttConfig::new("abc123-ats.iot.eu-west-1.amazonaws.com", 8883).client_id("pump-17"))
///     .cloud(profile);
/// assert!(config.is_single_session());
/// # let _ = options;
/// # Ok::<(), edge_outbox::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CloudProfile {
    /// AWS IoT Core: MQTT 5, mutual TLS on 8883 (or 443 with ALPN `x-amzn-mqtt-ca`), payloads up
    /// to 128 KiB, topics up to 256 bytes and 7 slashes (Basic Ingest's `$aws/rules/{rule}/`
    /// not counted), 100 messages in flight. Its reserved `$aws/` topics stay refused unless
    /// [`Limits::allow_dollar_topics`](crate::Limits::allow_dollar_topics).
    AwsIotCore,
    /// Azure IoT Hub: MQTT 3.1.1, one connection per device id, telemetry only on
    /// `devices/{device-id}/messages/events/` (and its own `$iothub/` topics), commands from
    /// `devices/{device-id}/messages/devicebound/`, messages up to 256 KiB, no retained messages.
    AzureIotHub,
    /// Azure Event Grid's MQTT broker: MQTT 5 (X.509 client certificates, or its other
    /// authentication methods, set as usual), messages up to 512 KiB, topics up to 256 bytes and
    /// 8 levels.
    AzureEventGrid,
}

impl CloudProfile {
    /// Every profile, in the order the CLI lists them.
    pub const ALL: [CloudProfile; 3] = [
        CloudProfile::AwsIotCore,
        CloudProfile::AzureIotHub,
        CloudProfile::AzureEventGrid,
    ];

    /// The name `--profile` takes: `aws-iot-core`, `azure-iot-hub` or `azure-event-grid`.
    pub fn name(self) -> &'static str {
        match self {
            CloudProfile::AwsIotCore => "aws-iot-core",
            CloudProfile::AzureIotHub => "azure-iot-hub",
            CloudProfile::AzureEventGrid => "azure-event-grid",
        }
    }

    /// The cloud's own name, for errors.
    pub(crate) fn cloud(self) -> &'static str {
        match self {
            CloudProfile::AwsIotCore => "AWS IoT Core",
            CloudProfile::AzureIotHub => "Azure IoT Hub",
            CloudProfile::AzureEventGrid => "Azure Event Grid",
        }
    }

    /// Largest MQTT message the cloud takes, in bytes.
    pub fn max_message_bytes(self) -> usize {
        match self {
            CloudProfile::AwsIotCore => 128 * 1024,
            CloudProfile::AzureIotHub => 256 * 1024,
            CloudProfile::AzureEventGrid => 512 * 1024,
        }
    }

    /// Most messages in flight (published, not yet acknowledged) the cloud allows a client, if
    /// it documents a cap.
    pub fn max_in_flight(self) -> Option<usize> {
        match self {
            CloudProfile::AwsIotCore => Some(100),
            CloudProfile::AzureIotHub | CloudProfile::AzureEventGrid => None,
        }
    }

    /// Whether the cloud keeps retained messages (a status topic and the schema topic need it).
    pub fn retains(self) -> bool {
        !matches!(self, CloudProfile::AzureIotHub)
    }

    /// The limit named in errors and dead letters for a message above
    /// [`max_message_bytes`](Self::max_message_bytes).
    pub(crate) fn message_limit_name(self) -> &'static str {
        match self {
            CloudProfile::AwsIotCore => "AWS IoT Core's message size limit (128 KiB)",
            CloudProfile::AzureIotHub => "Azure IoT Hub's message size limit (256 KiB)",
            CloudProfile::AzureEventGrid => "Azure Event Grid's message size limit (512 KiB)",
        }
    }

    /// The topic rules for the device `device_id`.
    pub(crate) fn topic_rules(self, device_id: &str) -> TopicRules {
        TopicRules::new(self, device_id)
    }
}

impl fmt::Display for CloudProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CloudProfile {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        CloudProfile::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = CloudProfile::ALL.iter().map(|p| p.name()).collect();
                Error::InvalidConfig(format!(
                    "unknown cloud profile {s:?}: one of {}",
                    names.join(", ")
                ))
            })
    }
}

/// Headroom kept below a cloud's message limit for the envelope, its key, type and headers, and
/// the topic, when the payload alone is checked where it is written. The relay checks the whole
/// packet before publishing.
pub(crate) const ENVELOPE_HEADROOM: usize = 2048;

/// A cloud's rules for the topics a device publishes to, beyond MQTT's own (which keep `$`
/// topics refused unless [`Limits::allow_dollar_topics`](crate::Limits::allow_dollar_topics)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TopicRules {
    profile: CloudProfile,
    /// Azure IoT Hub: device messages go to topics under this, and commands come from under
    /// `commands_prefix`.
    events_prefix: Option<String>,
    commands_prefix: Option<String>,
}

/// AWS IoT Core and Event Grid: topics up to this many bytes.
const MAX_TOPIC_BYTES: usize = 256;
/// AWS IoT Core: at most this many `/` in a topic (8 levels).
const AWS_MAX_SLASHES: usize = 7;
/// Event Grid: at most this many levels.
const EVENT_GRID_MAX_LEVELS: usize = 8;
/// AWS IoT Core's Basic Ingest prefix, `$aws/rules/{rule-name}/`, which does not count toward
/// its topic limits.
const AWS_BASIC_INGEST: &str = "$aws/rules/";
/// Azure IoT Hub's own topics (device twin, direct method replies), which a device may use.
const IOT_HUB_RESERVED: &str = "$iothub/";

impl TopicRules {
    fn new(profile: CloudProfile, device_id: &str) -> TopicRules {
        // A module identity's client id is `{device-id}/{module-id}`.
        let (events_prefix, commands_prefix) = match profile {
            CloudProfile::AzureIotHub => {
                let identity = match device_id.split_once('/') {
                    Some((device, module)) => format!("devices/{device}/modules/{module}"),
                    None => format!("devices/{device_id}"),
                };
                (
                    Some(format!("{identity}/messages/events/")),
                    Some(format!("{identity}/messages/devicebound/")),
                )
            }
            CloudProfile::AwsIotCore | CloudProfile::AzureEventGrid => (None, None),
        };
        TopicRules {
            profile,
            events_prefix,
            commands_prefix,
        }
    }

    /// Fails with [`Error::InvalidTopic`] naming the cloud's rule `topic` breaks.
    pub(crate) fn check(&self, topic: &str) -> Result<()> {
        let why = match self.profile {
            CloudProfile::AzureIotHub => match &self.events_prefix {
                Some(prefix)
                    if !topic.starts_with(prefix.as_str()) && !topic.starts_with(IOT_HUB_RESERVED) =>
                {
                    Some(
                        "Azure IoT Hub takes device messages only on devices/{device-id}/messages/events/ \
                     (the device id being the client id; devices/{device-id}/modules/{module-id}/... \
                     for a module) and its own $iothub/ topics",
                    )
                }
                _ => None,
            },
            _ => self.size_rule(topic),
        };
        invalid(topic, why)
    }

    /// Fails with [`Error::InvalidConfig`] if the cloud does not deliver commands on `filter`.
    pub(crate) fn check_commands_filter(&self, filter: &str) -> Result<()> {
        let why = match (&self.commands_prefix, self.profile) {
            (Some(prefix), _)
                if !filter.starts_with(prefix.as_str()) && !filter.starts_with(IOT_HUB_RESERVED) =>
            {
                Some(format!(
                    "Azure IoT Hub sends a device its messages under {prefix} (or its own $iothub/ topics)"
                ))
            }
            (None, _) => self.size_rule(filter).map(str::to_owned),
            _ => None,
        };
        match why {
            None => Ok(()),
            Some(why) => Err(Error::InvalidConfig(format!("command filter {filter:?}: {why}"))),
        }
    }

    /// AWS IoT Core's and Event Grid's size and depth limits.
    fn size_rule(&self, topic: &str) -> Option<&'static str> {
        match self.profile {
            CloudProfile::AwsIotCore => {
                let counted = basic_ingest_rest(topic).unwrap_or(topic);
                if counted.len() > MAX_TOPIC_BYTES {
                    Some("it is longer than 256 bytes, AWS IoT Core's topic limit")
                } else if counted.matches('/').count() > AWS_MAX_SLASHES {
                    Some("it has more than 7 slashes (8 levels), AWS IoT Core's topic depth limit")
                } else {
                    None
                }
            }
            CloudProfile::AzureEventGrid => {
                if topic.len() > MAX_TOPIC_BYTES {
                    Some("it is longer than 256 bytes, Azure Event Grid's topic limit")
                } else if topic.split('/').count() > EVENT_GRID_MAX_LEVELS {
                    Some("it has more than 8 levels, Azure Event Grid's topic limit")
                } else {
                    None
                }
            }
            CloudProfile::AzureIotHub => None,
        }
    }

    /// A topic that passes these rules, for gap notices whose own topic does not.
    pub(crate) fn fallback_topic(&self) -> Option<&str> {
        self.events_prefix.as_deref()
    }
}

/// What follows `$aws/rules/{rule-name}/` in a Basic Ingest topic.
fn basic_ingest_rest(topic: &str) -> Option<&str> {
    let rest = topic.strip_prefix(AWS_BASIC_INGEST)?;
    rest.split_once('/').map(|(_, after)| after)
}

fn invalid(topic: &str, why: Option<&'static str>) -> Result<()> {
    match why {
        None => Ok(()),
        Some(why) => Err(Error::InvalidTopic {
            topic: topic.to_owned(),
            why,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_an_unknown_one_lists_the_others() {
        for p in CloudProfile::ALL {
            assert_eq!(p.name().parse::<CloudProfile>().ok(), Some(p));
        }
        let e = "aws".parse::<CloudProfile>().expect_err("unknown");
        assert!(
            e.to_string()
                .contains("aws-iot-core, azure-iot-hub, azure-event-grid"),
            "{e}"
        );
    }

    #[test]
    fn each_rule_names_its_cloud_and_limit() {
        let aws = CloudProfile::AwsIotCore.topic_rules("pump-17");
        assert!(aws.check("pumps/17/started").is_ok());
        assert!(aws.check("a/b/c/d/e/f/g/h").is_ok(), "7 slashes");
        // Reserved topics are MQTT's `$` rule's (Limits::allow_dollar_topics), and Basic
        // Ingest's prefix does not count toward the limits.
        assert!(aws.check("$aws/things/pump-17/shadow/update").is_ok());
        assert!(aws.check("$aws/rules/ingest/a/b/c/d/e/f/g/h").is_ok());
        for (topic, why) in [
            ("a/b/c/d/e/f/g/h/i", "7 slashes"),
            (&"t".repeat(257) as &str, "256 bytes"),
            ("$aws/rules/ingest/a/b/c/d/e/f/g/h/i", "7 slashes"),
        ] {
            let e = aws.check(topic).expect_err(topic);
            assert!(
                e.to_string().contains(why) && e.to_string().contains("AWS IoT Core"),
                "{e}"
            );
        }
        assert!(aws.check(&"t".repeat(256)).is_ok());
        assert!(
            aws.check_commands_filter("a/b/c/d/e/f/g/h/#").is_err(),
            "8 slashes in a filter"
        );

        let hub = CloudProfile::AzureIotHub.topic_rules("pump-17");
        assert!(hub.check("devices/pump-17/messages/events/").is_ok());
        assert!(hub.check("devices/pump-17/messages/events/kind=start").is_ok());
        assert!(
            hub.check("$iothub/twin/PATCH/properties/reported/?$rid=1")
                .is_ok()
        );
        for topic in [
            "devices/pump-18/messages/events/",
            "pumps/17",
            "devices/pump-17/messages/devicebound/x",
        ] {
            let e = hub.check(topic).expect_err(topic);
            assert!(e.to_string().contains("Azure IoT Hub"), "{e}");
        }
        assert_eq!(hub.fallback_topic(), Some("devices/pump-17/messages/events/"));
        assert!(
            hub.check_commands_filter("devices/pump-17/messages/devicebound/#")
                .is_ok()
        );
        let e = hub
            .check_commands_filter("pumps/17/commands/#")
            .expect_err("not IoT Hub's");
        assert!(
            e.to_string().contains("devices/pump-17/messages/devicebound/"),
            "{e}"
        );
        let module = CloudProfile::AzureIotHub.topic_rules("pump-17/valve");
        assert!(
            module
                .check("devices/pump-17/modules/valve/messages/events/")
                .is_ok()
        );
        assert!(module.check("devices/pump-17/messages/events/").is_err());

        let grid = CloudProfile::AzureEventGrid.topic_rules("pump-17");
        assert!(grid.check("a/b/c/d/e/f/g/h").is_ok());
        assert!(grid.check("a/b/c/d/e/f/g/h/i").is_err());
        assert!(grid.check(&"t".repeat(257)).is_err());
    }
}
