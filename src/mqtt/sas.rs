//! Azure IoT Hub's shared access signatures: a token signed with the device's symmetric key,
//! made afresh for every connection and renewed, by a new connection, before it expires.

use std::fmt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use crate::error::{Error, Result};

/// The API version IoT Hub's MQTT username names.
const API_VERSION: &str = "2021-04-12";
/// The default token lifetime, as the Azure IoT device SDKs use.
const DEFAULT_LIFETIME: Duration = Duration::from_secs(3600);
/// Shorter tokens leave no room to connect and renew.
const MIN_LIFETIME: Duration = Duration::from_secs(2);

/// A device's symmetric key for Azure IoT Hub (a device identity with "symmetric key"
/// authentication). Given to [`MqttConfig::azure_sas`](crate::MqttConfig::azure_sas), it makes the
/// MQTT username IoT Hub expects (`{hub}/{device-id}/?api-version=2021-04-12`, the device id being
/// the client id) and, for every connection, a new SAS token as the password: `sr` the device's
/// resource URI `{hub}/devices/{device-id}`, `se` the expiry in seconds since 1970, `sig` the
/// HMAC-SHA256 of `sr` and `se` with the key, all URL-encoded. IoT Hub closes a connection whose
/// token expired, so each connection is replaced by a new one, with a new token, when a fifth of
/// the token's lifetime (at most five minutes) is left: the outbox resends from its oldest
/// unacknowledged row, so a renewal loses nothing.
///
/// `Debug` never shows the key.
///
/// ```
/// use std::time::Duration;
/// use edge_outbox::{MqttConfig, Protocol, SasKey};
/// let key = SasKey::from_base64("AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=")?
///     .lifetime(Duration::from_secs(3600));
/// assert!(!format!("{key:?}").contains("AAEC"));
/// let config = MqttConfig::from_url("mqtts://my-hub.azure-devices.net")?
///     .client_id("pump-17")
///     .protocol(Protocol::V311)
///     .azure_sas(key);
/// assert!(config.sas().is_some());
/// # Ok::<(), edge_outbox::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct SasKey {
    key: Vec<u8>,
    lifetime: Duration,
    hub: Option<String>,
}

impl fmt::Debug for SasKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SasKey")
            .field("lifetime", &self.lifetime)
            .field("hub", &self.hub)
            .finish_non_exhaustive()
    }
}

/// What a connection authenticates with, and when its token stops being accepted.
pub(crate) struct Signed {
    pub username: String,
    pub password: String,
    pub expires: SystemTime,
    /// When to replace the connection: before `expires`, with room to connect again.
    pub renew: SystemTime,
}

impl SasKey {
    /// The key as the Azure portal and CLI show it (base64). Errors do not repeat it.
    pub fn from_base64(key: &str) -> Result<Self> {
        let key = STANDARD
            .decode(key.trim())
            // base64's error names the offending byte: not repeated, it is part of the key.
            .map_err(|_| Error::InvalidConfig("SAS key: not base64".into()))?;
        if key.is_empty() {
            return Err(Error::InvalidConfig("SAS key is empty".into()));
        }
        Ok(SasKey {
            key,
            lifetime: DEFAULT_LIFETIME,
            hub: None,
        })
    }

    /// The key from the first line of the file at `path` (base64).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading SAS key file {}", path.display()), e))?;
        Self::from_base64(text.lines().next().unwrap_or("")).map_err(|e| match e {
            Error::InvalidConfig(why) => Error::InvalidConfig(format!("{why}, in {}", path.display())),
            other => other,
        })
    }

    /// How long each token is valid (default one hour; at least 2 s).
    pub fn lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = lifetime;
        self
    }

    /// The IoT hub's host name the tokens are for (default: the broker's host, the first one of
    /// a failover list, which is the hub's for a direct connection; set it when connecting
    /// through a gateway or by address).
    pub fn hub(mut self, host: impl Into<String>) -> Self {
        self.hub = Some(host.into());
        self
    }

    /// The token lifetime.
    pub fn token_lifetime(&self) -> Duration {
        self.lifetime
    }

    /// `connect_timeout`: a token must outlive the time one connection may take.
    pub(crate) fn validate(&self, connect_timeout: Duration) -> Result<()> {
        // A connection is renewed at lifetime - margin after its token was made: that must come
        // after the longest connect, or a slow connect is renewed as soon as it is up, again
        // and again.
        if self.lifetime.saturating_sub(self.margin()) <= connect_timeout {
            return Err(Error::InvalidConfig(format!(
                "SAS token lifetime {:?}: too short for the connect timeout ({connect_timeout:?}); \
                 a connection is renewed when a fifth of its token's life is left, which must \
                 come after the longest connect",
                self.lifetime
            )));
        }
        if self.lifetime < MIN_LIFETIME {
            return Err(Error::InvalidConfig(format!(
                "SAS token lifetime {:?}: at least {MIN_LIFETIME:?}, to leave time to connect and renew",
                self.lifetime
            )));
        }
        Ok(())
    }

    /// The MQTT username for device `device_id` on broker `host`.
    pub(crate) fn username(&self, host: &str, device_id: &str) -> String {
        format!(
            "{}/{device_id}/?api-version={API_VERSION}",
            self.hub.as_deref().unwrap_or(host)
        )
    }

    /// The username and a token valid for [`lifetime`](Self::lifetime) from `now`.
    pub(crate) fn sign(&self, host: &str, device_id: &str, now: SystemTime) -> Signed {
        let expires_secs = now
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .saturating_add(self.lifetime)
            .as_secs();
        let expires = UNIX_EPOCH + Duration::from_secs(expires_secs);
        let resource = format!("{}/devices/{device_id}", self.hub.as_deref().unwrap_or(host));
        let margin = self.margin();
        Signed {
            username: self.username(host, device_id),
            password: self.token(&resource, expires_secs),
            expires,
            renew: expires.checked_sub(margin).unwrap_or(expires),
        }
    }

    /// How long before its token expires a connection is replaced.
    fn margin(&self) -> Duration {
        (self.lifetime / 5).min(Duration::from_secs(300))
    }

    fn token(&self, resource: &str, expires_secs: u64) -> String {
        let sr = url_encode(resource);
        let hmac_key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.key);
        let signature = ring::hmac::sign(&hmac_key, format!("{sr}\n{expires_secs}").as_bytes());
        let sig = url_encode(&STANDARD.encode(signature.as_ref()));
        format!("SharedAccessSignature sr={sr}&sig={sig}&se={expires_secs}")
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters, as the SAS format wants
/// (`/` included).
fn url_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token computed independently (Python's hmac, base64 and urllib, as Azure's own sample
    /// does it) for this key, resource and expiry.
    #[test]
    fn the_token_is_the_one_azure_documents() {
        let key = SasKey::from_base64("AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=")
            .expect("key")
            .hub("stand-in-hub.azure-devices.net");
        let signed = key.sign(
            "127.0.0.1",
            "pump-17",
            UNIX_EPOCH + Duration::from_secs(1_767_222_000),
        );
        assert_eq!(
            signed.password,
            "SharedAccessSignature sr=stand-in-hub.azure-devices.net%2Fdevices%2Fpump-17\
             &sig=YoBTAEVkwmgPMU9WsoI%2BuSytIVJKAKoFRx5NRkaZ3NM%3D&se=1767225600"
        );
        assert_eq!(
            signed.username,
            "stand-in-hub.azure-devices.net/pump-17/?api-version=2021-04-12"
        );
        assert_eq!(signed.expires, UNIX_EPOCH + Duration::from_secs(1_767_225_600));
        assert_eq!(signed.renew, signed.expires - Duration::from_secs(300));
    }

    #[test]
    fn a_short_token_renews_a_fifth_of_its_life_early() {
        let key = SasKey::from_base64("AAEC")
            .expect("key")
            .lifetime(Duration::from_secs(10));
        let signed = key.sign("hub", "d", UNIX_EPOCH + Duration::from_secs(100));
        assert_eq!(signed.renew, UNIX_EPOCH + Duration::from_secs(108));
        let connect = Duration::from_secs(2);
        assert!(
            key.clone()
                .lifetime(Duration::from_secs(1))
                .validate(Duration::ZERO)
                .is_err()
        );
        assert!(
            key.clone()
                .lifetime(Duration::from_secs(2))
                .validate(connect)
                .is_err()
        );
        assert!(key.validate(connect).is_ok());
        let ten = Duration::from_secs(10);
        assert!(
            key.clone()
                .lifetime(Duration::from_secs(12))
                .validate(ten)
                .is_err()
        );
        assert!(
            key.clone()
                .lifetime(Duration::from_secs(13))
                .validate(ten)
                .is_ok()
        );
    }

    #[test]
    fn a_bad_key_is_refused_without_repeating_it() {
        let err = SasKey::from_base64("%%s3cret%%").expect_err("not base64");
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert!(SasKey::from_base64("  ").is_err());
    }
}
