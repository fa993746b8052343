//! An HTTP proxy between the device and its broker: the MQTT connection goes through an HTTP
//! `CONNECT` tunnel, for networks that let nothing out but through the proxy.

use std::fmt;

use super::config::{Authority, endpoint};
use crate::error::{Error, Result};
use crate::redact_url;

/// The port a proxy URL without one gets, as curl assumes.
const DEFAULT_PROXY_PORT: u16 = 1080;

/// An HTTP proxy the MQTT connection tunnels through with `CONNECT host:port` (feature
/// `http-proxy`), with optional basic authentication and a list of hosts reached directly.
///
/// TLS to the broker (`mqtts://`) runs inside the tunnel, end to end: the proxy sees only the
/// broker's name and port. The proxy itself is spoken to in plain HTTP, as most corporate
/// proxies are; its basic-auth password therefore crosses the local network in clear text, as it
/// does for curl and every other client of such a proxy.
///
/// `Debug` never shows the password.
///
/// ```
/// use edge_outbox::{HttpProxy, MqttConfig};
/// let proxy = HttpProxy::from_url("http://device:s3cret@proxy.corp:3128")?
///     .no_proxy("localhost,.plant.local");
/// assert!(proxy.applies_to("broker.example.com"));
/// assert!(!proxy.applies_to("historian.plant.local"));
/// assert!(!format!("{proxy:?}").contains("s3cret"));
/// let config = MqttConfig::new("broker.example.com", 8883).http_proxy(proxy);
/// assert!(config.proxy().is_some());
/// # Ok::<(), edge_outbox::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct HttpProxy {
    host: String,
    port: u16,
    auth: Option<(String, String)>,
    /// Host names (and domains, as suffixes) reached directly, lower case; `*` is every host.
    no_proxy: Vec<String>,
}

impl fmt::Debug for HttpProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpProxy")
            .field("proxy", &self.endpoint())
            .field("username", &self.auth.as_ref().map(|(user, _)| user))
            .field("no_proxy", &self.no_proxy)
            .finish()
    }
}

impl HttpProxy {
    /// A proxy at `host:port`, without authentication.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        HttpProxy {
            host: host.into(),
            port,
            auth: None,
            no_proxy: Vec::new(),
        }
    }

    /// Parses `http://[user[:password]@]host[:port]` (default port 1080, as curl assumes). A
    /// username and password become [basic authentication](Self::basic_auth), percent-escapes
    /// decoded. `https://` proxies (TLS to the proxy itself) are not supported and are refused.
    /// Errors never repeat the password.
    ///
    /// ```
    /// let proxy = edge_outbox::HttpProxy::from_url("http://proxy.corp:3128")?;
    /// assert_eq!(proxy.to_string(), "proxy.corp:3128");
    /// assert!(edge_outbox::HttpProxy::from_url("socks5://proxy.corp").is_err());
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn from_url(url: &str) -> Result<Self> {
        let shown = redact_url(url);
        let bad = |why: &str| Error::InvalidConfig(format!("proxy URL {shown:?}: {why}"));
        let rest = match url.split_once("://") {
            Some(("http", rest)) => rest,
            Some(("https", _)) => {
                return Err(bad(
                    "TLS to the proxy (https://) is not supported: give its plain http:// address \
                     (TLS to the broker still runs end to end inside the tunnel)",
                ));
            }
            _ => return Err(bad("expected http://[user:password@]host[:port]")),
        };
        let authority = Authority::parse(rest, DEFAULT_PROXY_PORT).map_err(bad)?;
        let proxy = HttpProxy::new(authority.host, authority.port);
        Ok(match authority.credentials {
            Some((user, password)) => proxy.basic_auth(user, password),
            None => proxy,
        })
    }

    /// Authenticate to the proxy with HTTP basic authentication. The password is never logged,
    /// printed or shown by `Debug`.
    pub fn basic_auth(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        self.auth = Some((username.into(), password.into()));
        self
    }

    /// Brokers reached directly, not through the proxy, in the `no_proxy` form most tools read:
    /// comma-separated host names, where `example.com` or `.example.com` also covers every host
    /// under it, and `*` covers every host. Names compare without regard to case; an IP address
    /// matches only itself (no CIDR ranges); ports are not part of an entry. Adds to what earlier
    /// calls gave.
    pub fn no_proxy(mut self, list: &str) -> Self {
        self.no_proxy.extend(
            list.split(',')
                .map(|entry| {
                    unbracket(entry.trim())
                        .trim_start_matches('.')
                        .to_ascii_lowercase()
                })
                .filter(|entry| !entry.is_empty()),
        );
        self
    }

    /// Whether a connection to the broker `host` goes through this proxy (it is not in the
    /// [`no_proxy`](Self::no_proxy) list).
    pub fn applies_to(&self, host: &str) -> bool {
        let host = unbracket(host).trim_end_matches('.').to_ascii_lowercase();
        !self.no_proxy.iter().any(|entry| {
            // An address matches only itself; a name covers the names under it too.
            let is_address = entry.parse::<std::net::IpAddr>().is_ok();
            entry == "*"
                || host == *entry
                || !is_address
                    && host
                        .strip_suffix(entry.as_str())
                        .is_some_and(|head| head.ends_with('.'))
        })
    }

    /// The proxy's host.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The username of its basic authentication, if any (the password has no getter).
    pub fn username(&self) -> Option<&str> {
        self.auth.as_ref().map(|(user, _)| user.as_str())
    }

    /// `host:port` of the proxy, for logs and status: never the credentials.
    pub(crate) fn endpoint(&self) -> String {
        endpoint(&self.host, self.port)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.host.is_empty() {
            return Err(Error::InvalidConfig("proxy host is empty".into()));
        }
        if self.port == 0 {
            return Err(Error::InvalidConfig("proxy port 0".into()));
        }
        Ok(())
    }

    /// rumqttc's form of it.
    pub(crate) fn rumqttc(&self) -> rumqttc::Proxy {
        rumqttc::Proxy {
            ty: rumqttc::ProxyType::Http,
            auth: match &self.auth {
                Some((username, password)) => rumqttc::ProxyAuth::Basic {
                    username: username.clone(),
                    password: password.clone(),
                },
                None => rumqttc::ProxyAuth::None,
            },
            // rumqttc joins address and port with a colon: an IPv6 address needs its brackets.
            addr: if self.host.contains(':') {
                format!("[{}]", self.host)
            } else {
                self.host.clone()
            },
            port: self.port,
        }
    }
}

/// `host` without the brackets of an IPv6 address.
fn unbracket(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

impl fmt::Display for HttpProxy {
    /// `host:port`: never the credentials.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.endpoint())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_say_why_without_the_password() {
        let p = HttpProxy::from_url("http://dev%40ice:s3c%3Aret@proxy.corp:3128/").expect("url");
        assert_eq!(
            (p.host(), p.port(), p.username()),
            ("proxy.corp", 3128, Some("dev@ice"))
        );
        assert_eq!(p.auth.as_ref().map(|(_, pw)| pw.as_str()), Some("s3c:ret"));
        assert!(!format!("{p:?}").contains("s3c"), "{p:?}");
        assert_eq!(
            HttpProxy::from_url("http://[::1]").expect("v6").endpoint(),
            "[::1]:1080"
        );
        for bad in [
            "proxy.corp:3128",
            "https://proxy.corp",
            "socks5://proxy.corp",
            "http://:3128",
            "http://u:s3cret@proxy:0",
            "http://u:s3cret@proxy:x",
            "http://:s3cret@proxy",
            "http://u:%zz@proxy",
        ] {
            let err = HttpProxy::from_url(bad).expect_err(bad);
            assert!(err.to_string().contains("proxy URL"), "{err}");
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
    }

    #[test]
    fn no_proxy_covers_names_domains_and_everything() {
        let p = HttpProxy::new("proxy", 3128).no_proxy(" localhost, .Plant.Local,10.0.0.7,,");
        for direct in [
            "localhost",
            "LOCALHOST",
            "plant.local",
            "hist.plant.local",
            "10.0.0.7",
            "a.plant.local.",
        ] {
            assert!(!p.applies_to(direct), "{direct}");
        }
        for proxied in [
            "example.com",
            "notplant.local",
            "10.0.0.70",
            "110.0.0.7",
            "localhost.example.com",
        ] {
            assert!(p.applies_to(proxied), "{proxied}");
        }
        assert!(!HttpProxy::new("proxy", 1).no_proxy("*").applies_to("anything"));
        let v6 = HttpProxy::new("::1", 3128).no_proxy("[fe80::2]");
        assert!(!v6.applies_to("fe80::2") && !v6.applies_to("[fe80::2]"));
        assert_eq!(v6.rumqttc().addr, "[::1]");
    }

    #[test]
    fn an_ipv6_broker_cannot_go_through_the_proxy() {
        let proxied = crate::MqttConfig::new("fe80::1", 1883).http_proxy(HttpProxy::new("proxy", 3128));
        let err = proxied.validate("id").expect_err("IPv6 through the proxy");
        assert!(err.to_string().contains("host name"), "{err}");
        let direct = crate::MqttConfig::new("fe80::1", 1883)
            .http_proxy(HttpProxy::new("proxy", 3128).no_proxy("[fe80::1]"));
        assert!(direct.validate("id").is_ok());
        assert!(HttpProxy::new("proxy", 1).applies_to("anything"));
    }
}
