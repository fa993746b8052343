//! How to reach the broker: the options `relay` and `send-command` share.

use std::path::{Path, PathBuf};

use clap::Args;
use edge_outbox::{HttpProxy, MqttConfig, Protocol, SasKey, TlsConfig};

use crate::Result;
use crate::exit::CliError;

#[derive(Debug, Clone, Args)]
pub struct BrokerArgs {
    /// mqtt://[USER[:PASSWORD]@]HOST[:PORT] (plain TCP, default port 1883) or mqtts://... (TLS,
    /// default port 8883, the system's CAs unless --ca). Repeat it for a failover list (the nodes
    /// of a cluster): the brokers are tried in turn, the next after each failed attempt or lost
    /// connection; all take the first one's scheme and credentials. Required (for the relay:
    /// here or as `broker` in --config).
    #[arg(long, value_name = "URL")]
    pub broker: Vec<String>,
    /// MQTT protocol version: 5, or 3.1.1 for brokers that do not speak 5 (a broker then cannot
    /// refuse a message: see docs/reliability.md) [default: 5, or the --profile's].
    #[arg(long, value_name = "VERSION", value_parser = ["5", "3.1.1"])]
    pub mqtt_version: Option<String>,
    /// Trust the CA certificates in this PEM file instead of the system's (mqtts only).
    #[arg(long, value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// Offer this protocol in the TLS handshake's ALPN extension (mqtts only; repeatable). AWS
    /// IoT Core on port 443 needs `x-amzn-mqtt-ca` (docs/operations.md).
    #[arg(long, value_name = "PROTOCOL")]
    pub alpn: Vec<String>,
    /// MQTT username.
    #[arg(long, value_name = "USER")]
    pub username: Option<String>,
    /// Read the password from this file (a trailing newline is ignored), again at every
    /// connection, so a rotated password needs no restart; never pass it as an argument, where
    /// other users see it.
    #[arg(
        long,
        value_name = "FILE",
        requires = "username",
        conflicts_with = "password_env"
    )]
    pub password_file: Option<PathBuf>,
    /// Read the password from this environment variable (for a service manager's credential
    /// store, e.g. systemd's `LoadCredential` with a wrapper, or a container's secrets).
    #[arg(long, value_name = "VAR", requires = "username")]
    pub password_env: Option<String>,
    /// Reach the broker through this HTTP proxy, by an HTTP CONNECT tunnel:
    /// http://[USER[:PASSWORD]@]HOST[:PORT] (default port 1080). TLS to the broker runs inside
    /// the tunnel. Prefer the config file for a proxy password: the process list is readable by
    /// other users.
    #[arg(long, value_name = "URL")]
    pub proxy: Option<String>,
    /// Brokers reached directly, not through --proxy: comma-separated host names, where a name
    /// covers its subdomains and `*` covers every host.
    #[arg(long, value_name = "LIST")]
    pub no_proxy: Option<String>,
    /// Azure IoT Hub: the device's symmetric key (base64, the file's first line). The relay then
    /// makes the username IoT Hub expects and a new SAS token for every connection, and replaces
    /// each connection before its token expires. The client id must be the device id.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["username", "password_file", "password_env"])]
    pub sas_key_file: Option<PathBuf>,
    /// How long each SAS token is valid, in seconds (default 3600; at least 2, and longer than
    /// the connect timeout).
    #[arg(long, value_name = "SECS")]
    pub sas_lifetime: Option<u64>,
    /// The URLs came from a config file, not the process list (which other users can read).
    #[arg(skip)]
    pub urls_from_file: bool,
    /// The proxy URL came from a config file, not the process list.
    #[arg(skip)]
    pub proxy_from_file: bool,
}

impl BrokerArgs {
    /// Broker settings from the arguments and the client certificate and key files for mutual
    /// TLS, if given (each command names those options its own way); every problem is a usage
    /// error (exit 2).
    pub fn mqtt(&self, client_auth: Option<(&Path, &Path)>) -> Result<MqttConfig> {
        let Some((first, more)) = self.broker.split_first() else {
            return Err(CliError::usage("--broker is required"));
        };
        let mut mqtt = MqttConfig::from_url(first)?;
        for url in more {
            let other = MqttConfig::from_url(url)?;
            if other.uses_tls() != mqtt.uses_tls() {
                return Err(CliError::usage(format!(
                    "every --broker of a failover list needs the same scheme (mqtt or mqtts): \
                     the one for {}:{} differs from the first",
                    other.host(),
                    other.port()
                )));
            }
            if other.username().is_some() && other.username() != mqtt.username() {
                return Err(CliError::usage(
                    "every --broker of a failover list uses the first one's credentials: give them once",
                ));
            }
            mqtt = mqtt.failover(other.host(), other.port());
        }
        if self.broker.iter().any(|url| has_password(url)) && mqtt.username().is_none() {
            return Err(CliError::usage(
                "credentials in a later --broker are not used: give them in the first",
            ));
        }
        if mqtt.username().is_some() {
            if self.username.is_some() {
                return Err(CliError::usage(
                    "credentials twice: give them in the --broker URL or with --username, not both",
                ));
            }
            if !self.urls_from_file && self.broker.iter().any(|url| has_password(url)) {
                tracing::warn!(
                    target: "edge_outbox::cli",
                    "the password in --broker is visible to other local users (process list): prefer --username with --password-file"
                );
            }
        }
        if let Some(version) = &self.mqtt_version {
            mqtt = mqtt.protocol(version.parse::<Protocol>()?);
        }
        if self.ca.is_some() || client_auth.is_some() || !self.alpn.is_empty() {
            if !mqtt.uses_tls() {
                // Named by host and port: the URL itself may carry a password.
                return Err(CliError::usage(format!(
                    "a CA, client certificates and ALPN need an mqtts:// broker URL, not mqtt://{}:{}",
                    mqtt.host(),
                    mqtt.port()
                )));
            }
            let tls = match &self.ca {
                Some(ca) => TlsConfig::with_ca_file(ca).map_err(usage)?,
                None => TlsConfig::system_roots(),
            };
            let tls = match client_auth {
                Some((cert, key)) => tls.client_auth_files(cert, key).map_err(usage)?,
                None => tls,
            };
            let tls = self.alpn.iter().fold(tls, |tls, p| tls.alpn(p.as_bytes()));
            mqtt = mqtt.tls(tls);
        }
        // Checked here rather than by the parser: either may come from the config file.
        if self.no_proxy.is_some() && self.proxy.is_none() {
            return Err(CliError::usage(
                "no-proxy without a proxy: give --proxy (or `proxy` in the config file)",
            ));
        }
        if self.sas_lifetime.is_some() && self.sas_key_file.is_none() {
            return Err(CliError::usage(
                "sas-lifetime without a SAS key: give --sas-key-file",
            ));
        }
        if let Some(url) = &self.proxy {
            let mut proxy = HttpProxy::from_url(url).map_err(usage)?;
            if let Some(list) = &self.no_proxy {
                proxy = proxy.no_proxy(list);
            }
            if !self.proxy_from_file && has_password(url) {
                tracing::warn!(
                    target: "edge_outbox::cli",
                    "the password in --proxy is visible to other local users (process list): prefer `proxy` in a config file of mode 600"
                );
            }
            mqtt = mqtt.http_proxy(proxy);
        }
        if let Some(file) = &self.sas_key_file {
            if mqtt.username().is_some() || self.username.is_some() {
                return Err(CliError::usage(
                    "a SAS key and a username: the SAS key makes the username and password, give one of them",
                ));
            }
            let key = SasKey::from_file(file)
                .map_err(usage)?
                .lifetime(std::time::Duration::from_secs(self.sas_lifetime.unwrap_or(3600)));
            mqtt = mqtt.azure_sas(key);
        }
        if let Some(user) = &self.username {
            mqtt = match (&self.password_file, &self.password_env) {
                // Read again at every connection: a rotated password needs no restart.
                (Some(file), _) => mqtt.credentials_file(user, file).map_err(usage)?,
                (None, Some(var)) => mqtt.credentials(
                    user,
                    std::env::var(var).map_err(|e| {
                        CliError::usage(format!("the password variable {var} (--password-env): {e}"))
                    })?,
                ),
                (None, None) => mqtt.credentials(user, String::new()),
            };
        }
        Ok(mqtt)
    }
}

/// Whether the URL's user info has a password (`user:password@`).
pub fn has_password(url: &str) -> bool {
    url.split_once("://")
        .and_then(|(_, rest)| rest.rsplit_once('@'))
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
}

fn usage(e: edge_outbox::Error) -> CliError {
    CliError::usage(e.to_string())
}
