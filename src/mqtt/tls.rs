//! TLS settings for the broker connection, turned into a rustls configuration for every
//! connection, so certificates and keys given as files are read again each time: a rotated file
//! takes effect at the next connection, without a restart.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::{Error, Result};

/// TLS settings: which CA to trust, for mutual TLS the client's certificate and key (PEM), and
/// the ALPN protocols to offer. What is given as a file is read when the setting is made (so a
/// missing file is an error at once) and again for every connection, so a rotated CA bundle,
/// certificate or key is used from the next connection on.
#[derive(Clone, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct TlsConfig {
    ca_pem: Option<Pem>,
    client_auth: Option<(Pem, Pem)>,
    alpn: Vec<Vec<u8>>,
}

/// PEM text given as it is, or a file read again at every connection.
#[derive(Clone, PartialEq, Eq)]
enum Pem {
    Text(Vec<u8>),
    /// The path, and what it held when the setting was made (mutant `credential-files-read-once`
    /// uses that instead of reading again).
    File(PathBuf, Vec<u8>),
}

impl Pem {
    fn file(path: &Path) -> Result<Pem> {
        Ok(Pem::File(path.to_path_buf(), read(path)?))
    }

    /// The PEM text now.
    fn now(&self) -> Result<Cow<'_, [u8]>> {
        match self {
            Pem::Text(pem) => Ok(Cow::Borrowed(pem)),
            Pem::File(_, first) if crate::mutant::active("credential-files-read-once") => {
                Ok(Cow::Borrowed(first))
            }
            Pem::File(path, _) => read(path).map(Cow::Owned),
        }
    }
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("TlsConfig")
            .field("custom_ca", &self.ca_pem.is_some())
            .field("client_auth", &self.client_auth.is_some())
            .field(
                "alpn",
                &self
                    .alpn
                    .iter()
                    .map(|p| String::from_utf8_lossy(p))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl TlsConfig {
    /// Trust the CA certificates in this PEM.
    pub fn with_ca_pem(ca_pem: impl Into<Vec<u8>>) -> Self {
        TlsConfig {
            ca_pem: Some(Pem::Text(ca_pem.into())),
            client_auth: None,
            alpn: Vec::new(),
        }
    }

    /// Trust the CA certificates in the PEM file at `path`, read now and again at every
    /// connection.
    pub fn with_ca_file(path: impl AsRef<Path>) -> Result<Self> {
        Ok(TlsConfig {
            ca_pem: Some(Pem::file(path.as_ref())?),
            client_auth: None,
            alpn: Vec::new(),
        })
    }

    /// Trust the operating system's root certificates.
    pub fn system_roots() -> Self {
        TlsConfig {
            ca_pem: None,
            client_auth: None,
            alpn: Vec::new(),
        }
    }

    /// Present this certificate chain and private key (PEM) for mutual TLS.
    pub fn client_auth_pem(mut self, cert_pem: impl Into<Vec<u8>>, key_pem: impl Into<Vec<u8>>) -> Self {
        self.client_auth = Some((Pem::Text(cert_pem.into()), Pem::Text(key_pem.into())));
        self
    }

    /// Present the certificate chain and private key in these PEM files for mutual TLS, read now
    /// and again at every connection: replace both files (each in one rename, key and
    /// certificate that belong together) and the next connection uses the new pair.
    pub fn client_auth_files(mut self, cert: impl AsRef<Path>, key: impl AsRef<Path>) -> Result<Self> {
        self.client_auth = Some((Pem::file(cert.as_ref())?, Pem::file(key.as_ref())?));
        Ok(self)
    }

    /// Offers `protocol` in the TLS handshake's ALPN extension (repeatable: offered in the order
    /// added). AWS IoT Core serves MQTT with mutual TLS on port 443 only to a client that offers
    /// `x-amzn-mqtt-ca`: the way through networks that open nothing but 443. A protocol name is
    /// 1 to 255 bytes; another length fails the connection's setup with
    /// [`Error::InvalidConfig`].
    ///
    /// ```
    /// let tls = edge_outbox::TlsConfig::system_roots().alpn("x-amzn-mqtt-ca");
    /// assert!(format!("{tls:?}").contains("x-amzn-mqtt-ca"));
    /// ```
    pub fn alpn(mut self, protocol: impl Into<Vec<u8>>) -> Self {
        self.alpn.push(protocol.into());
        self
    }

    /// Whether it offers any ALPN protocol.
    pub(crate) fn offers_alpn(&self) -> bool {
        !self.alpn.is_empty()
    }

    /// Whether any of it is read from files (and so again at every connection): the system's CA
    /// bundle too, which an OS update replaces.
    pub(crate) fn reads_files(&self) -> bool {
        let file = |pem: &Pem| matches!(pem, Pem::File(..));
        self.ca_pem.as_ref().is_none_or(file)
            || self
                .client_auth
                .as_ref()
                .is_some_and(|(cert, key)| file(cert) || file(key))
    }

    /// When the client certificate expires (its first, leaf, certificate's `notAfter`), as its
    /// file says now; `None` without one or when it cannot be read.
    pub(crate) fn client_cert_expiry(&self) -> Option<std::time::SystemTime> {
        let (cert_pem, _) = self.client_auth.as_ref()?;
        let pem = cert_pem.now().ok()?;
        let leaf = CertificateDer::pem_slice_iter(&pem).next()?.ok()?;
        super::cert_expiry::not_after(&leaf)
    }

    /// Whether a client certificate is presented (mutual TLS).
    pub(crate) fn has_client_auth(&self) -> bool {
        self.client_auth.is_some()
    }

    /// A rustls configuration with the ring provider passed explicitly, so nothing depends on a
    /// process-wide default provider being installed.
    pub(crate) fn client_config(&self) -> Result<Arc<rustls::ClientConfig>> {
        let bad = |what: &str, e: &dyn std::fmt::Display| Error::InvalidConfig(format!("TLS {what}: {e}"));
        let mut roots = RootCertStore::empty();
        match &self.ca_pem {
            Some(pem) => {
                for cert in CertificateDer::pem_slice_iter(&pem.now()?) {
                    roots
                        .add(cert.map_err(|e| bad("CA certificate", &e))?)
                        .map_err(|e| bad("CA certificate", &e))?;
                }
            }
            None => {
                let found = rustls_native_roots();
                for cert in found {
                    // A malformed system root is skipped, as browsers do.
                    let _ = roots.add(cert);
                }
            }
        }
        if roots.is_empty() {
            return Err(Error::InvalidConfig("TLS: no CA certificate to trust".into()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", &e))?
            .with_root_certificates(roots);
        if let Some(bad_name) = self.alpn.iter().find(|p| p.is_empty() || p.len() > 255) {
            return Err(Error::InvalidConfig(format!(
                "TLS ALPN protocol {:?}: a protocol name is 1 to 255 bytes",
                String::from_utf8_lossy(bad_name)
            )));
        }
        let mut config = match &self.client_auth {
            Some((cert_pem, key_pem)) => {
                let certs = CertificateDer::pem_slice_iter(&cert_pem.now()?)
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|e| bad("client certificate", &e))?;
                let key =
                    PrivateKeyDer::from_pem_slice(&key_pem.now()?).map_err(|e| bad("client key", &e))?;
                builder
                    .with_client_auth_cert(certs, key)
                    .map_err(|e| bad("client certificate", &e))?
            }
            None => builder.with_no_client_auth(),
        };
        if !crate::mutant::active("alpn-dropped") {
            config.alpn_protocols = self.alpn.clone();
        }
        Ok(Arc::new(config))
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

/// The system's root certificates from the usual PEM bundle locations.
fn rustls_native_roots() -> Vec<CertificateDer<'static>> {
    const BUNDLES: &[&str] = &[
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/pki/tls/certs/ca-bundle.crt",
        "/etc/ssl/cert.pem",
    ];
    BUNDLES
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .map(|pem| {
            CertificateDer::pem_slice_iter(&pem)
                .filter_map(|c| c.ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_ca_is_an_error_not_a_panic() {
        assert!(TlsConfig::with_ca_pem("not a pem").client_config().is_err());
    }
}
