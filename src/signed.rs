//! Signed commands (feature `signed-commands`): a device that trusts only some keys applies only
//! commands signed by one of them, whoever can publish on its command topic.
//!
//! A signed command is a COSE_Sign1 ([RFC 9052](https://www.rfc-editor.org/rfc/rfc9052), CBOR tag
//! 18) whose payload is the command's CBOR envelope, signed with Ed25519. Its protected header
//! holds the algorithm (`Ed25519`, -19; the older `EdDSA`, -8, is accepted too), the key id
//! (`kid`, the name the device knows the key by) and CWT claims (label 15, RFC 9597) with the
//! issue time `iat` (6) and the expiry `exp` (4), in seconds since the Unix epoch. The MQTT topic
//! is the signature's external additional data: a command signed for one device's topic does not
//! verify on another's.
//!
//! The device checks, before anything is stored as applicable: a well-formed COSE_Sign1, a key id
//! it trusts, a signature that verifies, and a validity window that holds now (`iat` at most
//! [`TrustedKeys::clock_skew`] ahead, no older than [`TrustedKeys::max_age`], `exp` not passed).
//! Anything else is dead-lettered with the reason. A replay of a valid command is a duplicate id
//! while the inbox remembers it, and too old once it could have been forgotten: the maximum age
//! must be below the inbox retention, which [`Outbox::open_with`](crate::Outbox::open_with) checks.
//!
//! **The policy is in the file.** The first open with
//! [`Options::trusted_command_keys`](crate::Options::trusted_command_keys) records the keys and
//! window in the database; every handle on it verifies with those, whatever its own options (see
//! `store::trust`), and they change only through
//! [`Outbox::require_signed_commands`](crate::Outbox::require_signed_commands), which logs it.
//!
//! **Key rotation.** Trust the new key next to the old one (each under its own key id) with
//! `Outbox::require_signed_commands`, move the senders to the new key, and once no command signed
//! with the old key can still be valid (after its maximum age), call it again without the old key.

use std::borrow::Cow;
use std::time::Duration;

use coset::cbor::value::Value;
use coset::iana;
use coset::{
    CborSerializable as _, CoseSign1, CoseSign1Builder, HeaderBuilder, Label, RegisteredLabelWithPrivate,
    TaggedCborSerializable as _,
};
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};

use crate::cbor;
use crate::envelope::Envelope;
use crate::error::{Error, Result};

/// COSE header parameter of CWT claims (RFC 9597), and the two claims used.
const CWT_CLAIMS: i64 = 15;
const CLAIM_EXP: i64 = 4;
const CLAIM_IAT: i64 = 6;

/// The public keys a device trusts to sign its commands, each under a key id, and how long a
/// signed command stays valid.
///
/// | setting | default |
/// |---|---|
/// | [`max_age`](Self::max_age) | 1 h |
/// | [`clock_skew`](Self::clock_skew) | 5 min |
///
/// ```
/// use edge_outbox::{Options, TrustedKeys};
///
/// let keys = TrustedKeys::new()
///     .key("cloud-2026", [0x3d, 0x40, 0x17, 0xc3, 0xe8, 0x43, 0x89, 0x5a, 0x92, 0xb7, 0x0a, 0xa7,
///         0x4d, 0x1b, 0x7e, 0xbc, 0x9c, 0x98, 0x2c, 0xcf, 0x2e, 0xc4, 0x96, 0x8c, 0xc0, 0xcd,
///         0x55, 0xf1, 0x2a, 0xf4, 0x66, 0x0c]);
/// let options = Options::new().trusted_command_keys(keys);
/// # let _ = options;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedKeys {
    keys: Vec<(String, [u8; 32])>,
    max_age: Duration,
    clock_skew: Duration,
}

impl Default for TrustedKeys {
    fn default() -> Self {
        TrustedKeys {
            keys: Vec::new(),
            max_age: Duration::from_secs(3600),
            clock_skew: Duration::from_secs(300),
        }
    }
}

impl TrustedKeys {
    /// No keys yet, the default window.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts the Ed25519 public key `public_key` (32 bytes) under `key_id`; a command names the
    /// key it was signed with by this id. Adding an id again replaces its key.
    pub fn key(mut self, key_id: impl Into<String>, public_key: [u8; 32]) -> Self {
        let key_id = key_id.into();
        self.keys.retain(|(id, _)| *id != key_id);
        self.keys.push((key_id, public_key));
        self
    }

    /// How long after it was issued a signed command is still accepted (default 1 h), whatever
    /// its own expiry says. Must be below [`Options::inbox_retention`](crate::Options::inbox_retention)
    /// (minus the clock skew): then a replay is either still remembered as a duplicate or
    /// already too old.
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = age;
        self
    }

    /// How far in the future a command's issue time may be, for senders whose clock runs ahead
    /// (default 5 min).
    pub fn clock_skew(mut self, skew: Duration) -> Self {
        self.clock_skew = skew;
        self
    }

    /// The key ids trusted, in the order they were added.
    pub fn key_ids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|(id, _)| id.as_str())
    }

    /// The keys (id, public key) and the window (maximum age, clock skew), for the store to
    /// record.
    pub(crate) fn parts(&self) -> (&[(String, [u8; 32])], Duration, Duration) {
        (&self.keys, self.max_age, self.clock_skew)
    }

    /// Keys and a window as a store recorded them.
    pub(crate) fn from_parts(keys: Vec<(String, [u8; 32])>, max_age: Duration, clock_skew: Duration) -> Self {
        TrustedKeys {
            keys,
            max_age,
            clock_skew,
        }
    }

    pub(crate) fn validate(&self, inbox_retention: Duration) -> Result<()> {
        if self.keys.is_empty() {
            return Err(Error::InvalidConfig(
                "trusted_command_keys has no key: every command would be refused".into(),
            ));
        }
        for (id, key) in &self.keys {
            if id.is_empty() {
                return Err(Error::InvalidConfig(
                    "a trusted command key has an empty key id".into(),
                ));
            }
            VerifyingKey::from_bytes(key).map_err(|e| {
                Error::InvalidConfig(format!(
                    "trusted command key {id:?} is not an Ed25519 public key: {e}"
                ))
            })?;
        }
        if self.max_age.is_zero() || self.max_age + self.clock_skew >= inbox_retention {
            return Err(Error::InvalidConfig(format!(
                "signed commands: max_age ({:?}) plus clock_skew ({:?}) must be above zero and below \
                 the inbox retention ({inbox_retention:?}), or a replay could arrive after its id \
                 was forgotten",
                self.max_age, self.clock_skew
            )));
        }
        Ok(())
    }

    /// Checks a signed command that arrived on `topic` and returns the envelope inside it with
    /// the id of the key that signed it, or why it is refused.
    pub(crate) fn open<'a>(
        &self,
        topic: &str,
        bytes: &'a [u8],
    ) -> std::result::Result<(Cow<'a, [u8]>, String), String> {
        // Our own reader first: well-formed, depth-bounded, one pass, before a general decoder.
        if let Err(e) = cbor::check_one_item(bytes) {
            return Err(format!("signed command: not a COSE_Sign1 ({e})"));
        }
        let sign1 = CoseSign1::from_tagged_slice(bytes)
            .or_else(|_| CoseSign1::from_slice(bytes))
            .map_err(|_| {
                if Envelope::decode(bytes).is_ok() {
                    "signed command: not signed; this device accepts only commands signed by a \
                     key it trusts (COSE_Sign1, see docs/wire-format.md)"
                        .to_owned()
                } else {
                    "signed command: not a COSE_Sign1 around an envelope".to_owned()
                }
            })?;
        let header = &sign1.protected.header;
        let alg_ok = matches!(
            header.alg,
            Some(RegisteredLabelWithPrivate::Assigned(
                iana::Algorithm::Ed25519 | iana::Algorithm::EdDSA
            ))
        );
        if !alg_ok {
            return Err(format!(
                "signed command: algorithm {:?} is not Ed25519 (or not in the protected header)",
                header.alg
            ));
        }
        let key_id = String::from_utf8_lossy(&header.key_id).into_owned();
        let public = self
            .keys
            .iter()
            .find(|(id, _)| id.as_bytes() == header.key_id.as_slice())
            .map(|(_, key)| key)
            .ok_or_else(|| format!("signed command: key id {key_id:?} is not a trusted key"))?;
        let verifying = VerifyingKey::from_bytes(public)
            .map_err(|e| format!("signed command: trusted key {key_id:?} is unusable: {e}"))?;
        sign1
            .verify_signature(topic.as_bytes(), |sig, data| {
                let sig = Signature::from_slice(sig).map_err(|e| e.to_string())?;
                verifying.verify_strict(data, &sig).map_err(|e| e.to_string())
            })
            .map_err(|_| {
                format!(
                    "signed command: the signature does not verify with key {key_id:?} (altered, \
                     signed with another key, or signed for another topic than {topic:?})"
                )
            })?;
        let (iat, exp) = claims(header)?;
        let now = now_secs();
        if iat > now.saturating_add(self.clock_skew.as_secs()) {
            return Err(format!(
                "signed command: issued at {iat}, more than {:?} ahead of this device's clock ({now})",
                self.clock_skew
            ));
        }
        if now >= exp {
            return Err(format!("signed command: expired at {exp} (now {now})"));
        }
        if now.saturating_sub(iat) > self.max_age.as_secs() {
            return Err(format!(
                "signed command: issued at {iat}, older than the maximum age of {:?} (now {now}): \
                 expired, or a replay",
                self.max_age
            ));
        }
        let payload = sign1
            .payload
            .ok_or_else(|| "signed command: the COSE_Sign1 has no payload".to_owned())?;
        Ok((Cow::Owned(payload), key_id))
    }
}

/// The `iat` and `exp` claims of the protected header.
fn claims(header: &coset::Header) -> std::result::Result<(u64, u64), String> {
    let claims = header
        .rest
        .iter()
        .find(|(label, _)| *label == Label::Int(CWT_CLAIMS))
        .and_then(|(_, v)| v.as_map())
        .ok_or("signed command: no CWT claims (label 15) in the protected header")?;
    let claim = |key: i64, name: &str| {
        claims
            .iter()
            .find(|(k, _)| k.as_integer() == Some(key.into()))
            .and_then(|(_, v)| v.as_integer())
            .and_then(|i| u64::try_from(i).ok())
            .ok_or_else(|| format!("signed command: no {name} claim"))
    };
    Ok((
        claim(CLAIM_IAT, "issued-at (iat)")?,
        claim(CLAIM_EXP, "expiry (exp)")?,
    ))
}

fn now_secs() -> u64 {
    u64::try_from(crate::time::now_ms() / 1000).unwrap_or(0)
}

/// Signs commands on the cloud side, with an Ed25519 key the devices trust under `key_id`.
///
/// ```
/// use std::time::Duration;
/// use edge_outbox::{CommandSigner, Envelope, MessageId};
///
/// // The 32-byte secret comes from your key store; never from source code in production.
/// let signer = CommandSigner::from_secret_key("cloud-2026", [7u8; 32]);
/// let command = Envelope::command(MessageId::new_v7(), "pump-17", &("set_rate", 12.5))?;
/// let topic = "devices/pump-17/commands/rate";
/// let signed: Vec<u8> = signer.sign(topic, &command, Duration::from_secs(600))?;
/// // Publish `signed` on `topic` at QoS 1; devices trust `signer.public_key()` as "cloud-2026".
/// # assert!(!signed.is_empty());
/// # Ok::<(), edge_outbox::Error>(())
/// ```
#[derive(Clone)]
pub struct CommandSigner {
    key_id: String,
    key: SigningKey,
}

impl std::fmt::Debug for CommandSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("CommandSigner")
            .field("key_id", &self.key_id)
            .field("public_key", &self.public_key())
            .finish_non_exhaustive()
    }
}

impl CommandSigner {
    /// A signer with the Ed25519 secret key `secret` (32 bytes), known to devices as `key_id`.
    pub fn from_secret_key(key_id: impl Into<String>, secret: [u8; 32]) -> Self {
        CommandSigner {
            key_id: key_id.into(),
            key: SigningKey::from_bytes(&secret),
        }
    }

    /// The public key to configure on devices ([`TrustedKeys::key`]).
    pub fn public_key(&self) -> [u8; 32] {
        self.key.verifying_key().to_bytes()
    }

    /// The key id commands are signed under.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// Signs `command` for `topic`, issued now and valid for `valid_for`, and returns the bytes to
    /// publish. A resend of the same command (same id) may be signed again: the device applies
    /// its id once.
    pub fn sign(&self, topic: &str, command: &Envelope<'_>, valid_for: Duration) -> Result<Vec<u8>> {
        let now = now_secs();
        self.sign_at(
            topic,
            command,
            now,
            now.saturating_add(valid_for.as_secs().max(1)),
        )
    }

    /// Signs `command` for `topic` with an explicit issue time and expiry (seconds since the Unix
    /// epoch).
    pub fn sign_at(
        &self,
        topic: &str,
        command: &Envelope<'_>,
        issued_at: u64,
        expires_at: u64,
    ) -> Result<Vec<u8>> {
        let claims = Value::Map(vec![
            (Value::Integer(CLAIM_IAT.into()), Value::Integer(issued_at.into())),
            (
                Value::Integer(CLAIM_EXP.into()),
                Value::Integer(expires_at.into()),
            ),
        ]);
        let protected = HeaderBuilder::new()
            .algorithm(iana::Algorithm::Ed25519)
            .key_id(self.key_id.as_bytes().to_vec())
            .value(CWT_CLAIMS, claims)
            .build();
        CoseSign1Builder::new()
            .protected(protected)
            .payload(command.encode())
            .create_signature(topic.as_bytes(), |data| self.key.sign(data).to_bytes().to_vec())
            .build()
            .to_tagged_vec()
            .map_err(|e| Error::Encode(format!("COSE_Sign1: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use coset::iana::EnumI64 as _;

    #[test]
    fn the_algorithm_label_is_ed25519() {
        assert_eq!(iana::Algorithm::Ed25519.to_i64(), -19);
    }
}
