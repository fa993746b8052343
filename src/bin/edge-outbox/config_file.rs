//! `edge-outbox relay --config FILE`: the relay's settings in a TOML file. Every relay option has
//! a key of the same name without its dashes in front (`--max-in-flight 50` is
//! `max-in-flight = 50`), with the same values; an option given on the command line wins over its
//! key. Values are checked while the file is read, with the same checks as the options, so an
//! error names the file, the line and the key.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use crate::Result;
use crate::broker_args::has_password;
use crate::exit::CliError;
use crate::logging::{LogFormat, LogLevel};
use crate::relay::{RelayArgs, parse_lifetime, parse_mode};

/// A relay config file, as read: a key left out is `None`.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RelayFile {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub db: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub app: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub busy_timeout: Option<u64>,
    #[serde(
        default,
        deserialize_with = "brokers",
        skip_serializing_if = "Option::is_none"
    )]
    pub broker: Option<Vec<String>>,
    #[serde(
        default,
        deserialize_with = "mqtt_version",
        skip_serializing_if = "Option::is_none"
    )]
    pub mqtt_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alpn: Option<Vec<String>>,
    #[serde(
        default,
        deserialize_with = "proxy_url",
        skip_serializing_if = "Option::is_none"
    )]
    pub proxy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_proxy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sas_key_file: Option<PathBuf>,
    #[serde(
        default,
        deserialize_with = "at_least_one",
        skip_serializing_if = "Option::is_none"
    )]
    pub sas_lifetime: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
    #[serde(
        default,
        deserialize_with = "not_empty",
        skip_serializing_if = "Option::is_none"
    )]
    pub client_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trusted_key: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub src: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commands: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commands_client_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub single_session: Option<bool>,
    #[serde(
        default,
        deserialize_with = "cloud_profile",
        skip_serializing_if = "Option::is_none"
    )]
    pub profile: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing_fields: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envelope: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_topic: Option<String>,
    #[serde(
        default,
        deserialize_with = "at_least_one",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_in_flight: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_timeout: Option<u64>,
    #[serde(
        default,
        deserialize_with = "at_least_one",
        skip_serializing_if = "Option::is_none"
    )]
    pub ack_timeout: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poison_disconnects: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic_aliases: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_message_expiry: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_mode: Option<Mode>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_max_bytes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_linger_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_zlib: Option<bool>,
    #[serde(
        default,
        deserialize_with = "at_least_one",
        skip_serializing_if = "Option::is_none"
    )]
    pub pace_messages: Option<u32>,
    #[serde(
        default,
        deserialize_with = "at_least_one",
        skip_serializing_if = "Option::is_none"
    )]
    pub pace_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expire: Option<Vec<Lifetime>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<LogFormat>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_level: Option<LogLevel>,
}

/// A metrics file mode, written as the option takes it: an octal string such as `"640"`.
#[derive(Debug, Clone, Copy)]
pub struct Mode(pub u32);

impl<'de> Deserialize<'de> for Mode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_mode(&text).map(Mode).map_err(de::Error::custom)
    }
}

impl Serialize for Mode {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:o}", self.0))
    }
}

/// An `--expire` rule, written as the option takes it: `"FILTER=SECS"`.
#[derive(Debug, Clone)]
pub struct Lifetime(pub String, pub Duration);

impl<'de> Deserialize<'de> for Lifetime {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let (filter, lifetime) = parse_lifetime(&text).map_err(de::Error::custom)?;
        Ok(Lifetime(filter, lifetime))
    }
}

impl Serialize for Lifetime {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{}={}", self.0, self.1.as_secs()))
    }
}

/// `broker = "URL"` or `broker = ["URL", ...]` (a failover list), each URL checked as
/// `--broker` checks it.
fn brokers<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<Vec<String>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    let urls = match OneOrMany::deserialize(d)? {
        OneOrMany::One(url) => vec![url],
        OneOrMany::Many(urls) => urls,
    };
    if urls.is_empty() {
        return Err(de::Error::custom(
            "the failover list is empty: name at least one broker",
        ));
    }
    for url in &urls {
        // The library's message shows the URL with its password replaced.
        let _checked = edge_outbox::MqttConfig::from_url(url).map_err(de::Error::custom)?;
    }
    Ok(Some(urls))
}

/// `proxy = "URL"`, checked as `--proxy` checks it.
fn proxy_url<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<String>, D::Error> {
    let url = String::deserialize(d)?;
    // The library's message shows the URL with its password replaced.
    let _checked = edge_outbox::HttpProxy::from_url(&url).map_err(de::Error::custom)?;
    Ok(Some(url))
}

fn mqtt_version<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<String>, D::Error> {
    let version = String::deserialize(d)?;
    version
        .parse::<edge_outbox::Protocol>()
        .map_err(de::Error::custom)?;
    Ok(Some(version))
}

fn cloud_profile<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<String>, D::Error> {
    let name = String::deserialize(d)?;
    name.parse::<edge_outbox::CloudProfile>()
        .map_err(de::Error::custom)?;
    Ok(Some(name))
}

fn not_empty<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<String>, D::Error> {
    let text = String::deserialize(d)?;
    if text.is_empty() {
        return Err(de::Error::custom("must not be empty"));
    }
    Ok(Some(text))
}

/// A count or a duration that must be at least 1, as the option's range says.
fn at_least_one<'de, D, T>(d: D) -> std::result::Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default + PartialEq,
{
    let value = T::deserialize(d)?;
    if value == T::default() {
        return Err(de::Error::custom("must be at least 1"));
    }
    Ok(Some(value))
}

/// Reads and checks `path`. Every error is a usage error naming the file, the line and the key.
pub fn load(path: &Path) -> Result<RelayFile> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::usage(format!("reading config file {}: {e}", path.display())))?;
    let file: RelayFile = toml::from_str(&text).map_err(|e| {
        CliError::usage(format!(
            "config file {}{}: {}",
            path.display(),
            place(&text, &e),
            e.message()
        ))
    })?;
    let password_in_url = file
        .broker
        .iter()
        .flatten()
        .chain(&file.proxy)
        .any(|url| has_password(url));
    if password_in_url && readable_by_others(path) {
        tracing::warn!(
            target: "edge_outbox::cli",
            path = %path.display(),
            "the config file holds a password (broker or proxy URL) and other users can read it: chmod 600, or use password-file"
        );
    }
    Ok(file)
}

/// `, line N, key K` for the error's place in `text`, as far as toml knows it.
fn place(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return String::new();
    };
    let start = span.start.min(text.len());
    let before = text.get(..start).unwrap_or("");
    let after = text.get(start..).unwrap_or("");
    let line_no = before.matches('\n').count() + 1;
    let line = format!(
        "{}{}",
        before.rsplit('\n').next().unwrap_or(""),
        after.split('\n').next().unwrap_or("")
    );
    match line.split_once('=') {
        Some((key, _)) if !key.trim().starts_with('[') => {
            format!(", line {line_no}, key {}", key.trim())
        }
        _ => format!(", line {line_no}"),
    }
}

#[cfg(unix)]
fn readable_by_others(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o077 != 0)
}

#[cfg(not(unix))]
fn readable_by_others(_path: &Path) -> bool {
    false
}

/// Applies the file's keys to `args`, except where the option was given on the command line
/// (`given` answers by the option's id).
pub fn merge(file: RelayFile, args: &mut RelayArgs, given: impl Fn(&str) -> bool) {
    // `slot` takes `value` unless its option was given.
    fn take<T>(slot: &mut T, value: Option<T>, on_command_line: bool) {
        if let (false, Some(value)) = (on_command_line, value) {
            *slot = value;
        }
    }
    let b = &mut args.broker;
    b.urls_from_file = file.broker.is_some() && !given("broker");
    take(&mut b.broker, file.broker, given("broker"));
    take(
        &mut b.mqtt_version,
        file.mqtt_version.map(Some),
        given("mqtt_version"),
    );
    take(&mut b.ca, file.ca.map(Some), given("ca"));
    take(&mut b.alpn, file.alpn, given("alpn"));
    b.proxy_from_file = file.proxy.is_some() && !given("proxy");
    take(&mut b.proxy, file.proxy.map(Some), given("proxy"));
    take(&mut b.no_proxy, file.no_proxy.map(Some), given("no_proxy"));
    take(
        &mut b.sas_key_file,
        file.sas_key_file.map(Some),
        given("sas_key_file"),
    );
    take(
        &mut b.sas_lifetime,
        file.sas_lifetime.map(Some),
        given("sas_lifetime"),
    );
    take(&mut b.username, file.username.map(Some), given("username"));
    take(
        &mut b.password_file,
        file.password_file.map(Some),
        given("password_file"),
    );
    take(
        &mut b.password_env,
        file.password_env.map(Some),
        given("password_env"),
    );
    take(&mut args.client_id, file.client_id.map(Some), given("client_id"));
    #[cfg(feature = "signed-commands")]
    take(&mut args.trusted_key, file.trusted_key, given("trusted_key"));
    #[cfg(not(feature = "signed-commands"))]
    let _ = file.trusted_key;
    take(&mut args.src, file.src.map(Some), given("src"));
    take(&mut args.commands, file.commands.map(Some), given("commands"));
    take(
        &mut args.commands_client_id,
        file.commands_client_id.map(Some),
        given("commands_client_id"),
    );
    take(
        &mut args.single_session,
        file.single_session,
        given("single_session"),
    );
    take(&mut args.profile, file.profile.map(Some), given("profile"));
    take(
        &mut args.routing_fields,
        file.routing_fields.map(Some),
        given("routing_fields"),
    );
    take(&mut args.envelope, file.envelope.map(Some), given("envelope"));
    take(&mut args.cert, file.cert.map(Some), given("cert"));
    take(&mut args.key, file.key.map(Some), given("key"));
    take(
        &mut args.status_topic,
        file.status_topic.map(Some),
        given("status_topic"),
    );
    take(
        &mut args.max_in_flight,
        file.max_in_flight,
        given("max_in_flight"),
    );
    take(
        &mut args.shutdown_timeout,
        file.shutdown_timeout,
        given("shutdown_timeout"),
    );
    take(&mut args.ack_timeout, file.ack_timeout, given("ack_timeout"));
    take(
        &mut args.poison_disconnects,
        file.poison_disconnects,
        given("poison_disconnects"),
    );
    take(
        &mut args.topic_aliases,
        file.topic_aliases,
        given("topic_aliases"),
    );
    take(
        &mut args.no_message_expiry,
        file.no_message_expiry,
        given("no_message_expiry"),
    );
    take(
        &mut args.metrics_file,
        file.metrics_file.map(Some),
        given("metrics_file"),
    );
    take(
        &mut args.metrics_mode,
        file.metrics_mode.map(|m| Some(m.0)),
        given("metrics_mode"),
    );
    take(&mut args.progress, file.progress, given("progress"));
    take(&mut args.batch, file.batch, given("batch"));
    take(
        &mut args.batch_max_bytes,
        file.batch_max_bytes,
        given("batch_max_bytes"),
    );
    take(
        &mut args.batch_linger_ms,
        file.batch_linger_ms,
        given("batch_linger_ms"),
    );
    take(&mut args.batch_zlib, file.batch_zlib, given("batch_zlib"));
    take(
        &mut args.pace_messages,
        file.pace_messages.map(Some),
        given("pace_messages"),
    );
    take(
        &mut args.pace_bytes,
        file.pace_bytes.map(Some),
        given("pace_bytes"),
    );
    let expire = file
        .expire
        .map(|rules| rules.into_iter().map(|Lifetime(f, l)| (f, l)).collect());
    take(&mut args.expire, expire, given("expire"));
    take(&mut args.log_format, file.log_format, given("log_format"));
    take(&mut args.log_level, file.log_level, given("log_level"));
}

/// The settings `args` (and the database options) amount to, as a config file would say them,
/// every default written out: what `config check` prints. A password in a broker URL is shown
/// as `***`; a password file or variable is named, never read out.
pub fn effective(args: &RelayArgs, db: &Path, busy_timeout: u64) -> RelayFile {
    let b = &args.broker;
    RelayFile {
        db: Some(db.to_path_buf()),
        app: None,
        busy_timeout: Some(busy_timeout),
        broker: Some(b.broker.iter().map(|url| edge_outbox::redact_url(url)).collect()),
        // As used: given, or the profile's, or 5.
        mqtt_version: Some(b.mqtt_version.clone().unwrap_or_else(|| {
            args.profile
                .as_deref()
                .and_then(|p| p.parse::<edge_outbox::CloudProfile>().ok())
                .map_or(edge_outbox::Protocol::V5, edge_outbox::CloudProfile::protocol)
                .as_str()
                .to_owned()
        })),
        ca: b.ca.clone(),
        alpn: Some(b.alpn.clone()).filter(|a| !a.is_empty()),
        proxy: b.proxy.as_deref().map(edge_outbox::redact_url),
        no_proxy: b.no_proxy.clone(),
        sas_key_file: b.sas_key_file.clone(),
        sas_lifetime: b.sas_key_file.as_ref().map(|_| b.sas_lifetime.unwrap_or(3600)),
        username: b.username.clone(),
        password_file: b.password_file.clone(),
        password_env: b.password_env.clone(),
        client_id: args.client_id.clone(),
        #[cfg(feature = "signed-commands")]
        trusted_key: Some(args.trusted_key.clone()).filter(|k| !k.is_empty()),
        #[cfg(not(feature = "signed-commands"))]
        trusted_key: None,
        src: Some(args.src.clone().or_else(|| args.client_id.clone())).flatten(),
        commands: args.commands.clone(),
        commands_client_id: args.commands_client_id.clone(),
        single_session: args
            .commands
            .as_ref()
            .map(|_| args.single_session || args.profile.is_some()),
        profile: args.profile.clone(),
        routing_fields: Some(args.routing_fields.unwrap_or(args.profile.is_some())),
        envelope: Some(args.envelope.clone().unwrap_or_else(|| "cbor".into())),
        cert: args.cert.clone(),
        key: args.key.clone(),
        status_topic: args.status_topic.clone(),
        max_in_flight: Some(args.max_in_flight),
        shutdown_timeout: Some(args.shutdown_timeout),
        ack_timeout: Some(args.ack_timeout),
        poison_disconnects: Some(args.poison_disconnects),
        topic_aliases: Some(args.topic_aliases),
        no_message_expiry: Some(args.no_message_expiry),
        metrics_file: args.metrics_file.clone(),
        metrics_mode: args
            .metrics_file
            .as_ref()
            .map(|_| Mode(args.metrics_mode.unwrap_or(0o600))),
        progress: Some(args.progress),
        batch: Some(args.batch.clone()).filter(|b| !b.is_empty()),
        batch_max_bytes: Some(args.batch_max_bytes),
        batch_linger_ms: Some(args.batch_linger_ms),
        batch_zlib: Some(args.batch_zlib),
        pace_messages: args.pace_messages,
        pace_bytes: args.pace_bytes,
        expire: Some(args.expire.iter().map(|(f, l)| Lifetime(f.clone(), *l)).collect())
            .filter(|e: &Vec<Lifetime>| !e.is_empty()),
        log_format: Some(args.log_format),
        log_level: Some(args.log_level),
    }
}
