//! Azure IoT Hub's rules for a device authenticating with a symmetric key, as a check for
//! [`MqttProxy::authenticate`](super::mqtt_proxy::MqttProxy::authenticate), so the proxy stands
//! in for the hub in front of the test broker:
//!
//! - the client id is a device id the hub knows;
//! - the username is `{hub}/{device-id}/?api-version=2021-04-12`;
//! - the password is `SharedAccessSignature sr=...&sig=...&se=...` (fields in any order), with
//!   `sr` the URL-encoded `{hub}/devices/{device-id}`, `se` a time in the future (seconds since
//!   1970), and `sig` the URL-encoded base64 of the HMAC-SHA256, with the device's key, of `sr`,
//!   a newline and `se`;
//! - the connection is closed when the token expires.
//!
//! Written from the documented format, apart from the crate's own code, so a misreading of the
//! format in one is not repeated in the other.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::mqtt_proxy::{AuthResult, Connect};

#[derive(Clone)]
pub struct Hub {
    pub host: String,
    pub device_id: String,
    pub key: Vec<u8>,
}

impl Hub {
    /// A hub named `host` that knows one device, with a fresh 32-byte key.
    pub fn new(host: &str, device_id: &str) -> Hub {
        let key: Vec<u8> = uuid_bytes().into_iter().chain(uuid_bytes()).collect();
        Hub {
            host: host.into(),
            device_id: device_id.into(),
            key,
        }
    }

    /// The device's key as the portal shows it.
    pub fn key_base64(&self) -> String {
        STANDARD.encode(&self.key)
    }

    /// The verdict on one CONNECT: when its token expires, or why it is refused.
    pub fn check(&self, connect: &Connect) -> AuthResult {
        if connect.client_id != self.device_id {
            return Err(format!("unknown device id {:?}", connect.client_id));
        }
        let expected_user = format!("{}/{}/?api-version=2021-04-12", self.host, self.device_id);
        if connect.username.as_deref() != Some(expected_user.as_str()) {
            return Err(format!("username {:?}, not {expected_user:?}", connect.username));
        }
        let password = connect
            .password
            .as_ref()
            .and_then(|p| String::from_utf8(p.clone()).ok())
            .ok_or("no password")?;
        let fields = password
            .strip_prefix("SharedAccessSignature ")
            .ok_or("the password is not a SharedAccessSignature")?;
        let field = |name: &str| {
            fields
                .split('&')
                .find_map(|f| f.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
                .map(str::to_owned)
                .ok_or(format!("no {name} in the token"))
        };
        let (sr, sig, se) = (field("sr")?, field("sig")?, field("se")?);
        let resource = format!("{}/devices/{}", self.host, self.device_id);
        if decode(&sr).to_lowercase() != resource.to_lowercase() {
            return Err(format!("sr {sr:?} is not the device's resource {resource:?}"));
        }
        let expires = UNIX_EPOCH + Duration::from_secs(se.parse().map_err(|_| format!("se {se:?}"))?);
        if expires <= SystemTime::now() {
            return Err(format!("the token expired at se={se}"));
        }
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.key);
        let expected = STANDARD.encode(ring::hmac::sign(&key, format!("{sr}\n{se}").as_bytes()));
        if decode(&sig) != expected {
            return Err("the signature does not match the device's key".into());
        }
        Ok(Some(expires))
    }
}

/// Decodes `%XX` escapes (what the hub does with `sr` and `sig`).
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match (
            bytes[i],
            text.get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok()),
        ) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn uuid_bytes() -> [u8; 16] {
    *edge_outbox::MessageId::new_v7().as_bytes()
}
