//! Certificates generated at run time (rcgen, no outside tool): a CA, a server certificate for
//! `127.0.0.1` and `localhost`, and a client certificate, all ECDSA P-256, valid for two days, with
//! the extensions rustls/webpki insist on (v3, CA basic constraints, key usage, extended key usage,
//! subject alternative names).
//!
//! Two `Pki::generate` calls give two unrelated CAs: trust one, connect to a broker using the
//! other, and the handshake must fail.

use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

use super::broker::TlsListener;

/// rumqttc is built with `use-rustls-no-provider`: a process-wide rustls provider must be
/// installed before the first TLS connection. Idempotent.
pub fn install_crypto_provider() {
    // Err only means one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// PEM files of one CA and the certificates it signed.
#[derive(Debug, Clone)]
pub struct Pki {
    pub dir: PathBuf,
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl Pki {
    /// Writes a new CA, server and client certificate into `dir` (created if missing). `name`
    /// goes into the subjects, to tell CAs apart in logs.
    pub fn generate(dir: &Path, name: &str) -> io::Result<Pki> {
        fs::create_dir_all(dir)?;
        let p = |f: &str| dir.join(f);
        let pki = Pki {
            dir: dir.to_path_buf(),
            ca_cert: p("ca.crt"),
            ca_key: p("ca.key"),
            server_cert: p("server.crt"),
            server_key: p("server.key"),
            client_cert: p("client.crt"),
            client_key: p("client.key"),
        };
        let ca_key = new_key()?;
        let mut ca = params(&format!("edge-outbox test CA {name}"), Vec::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).map_err(tls_error)?;

        let server_key = new_key()?;
        let mut server = params(&format!("127.0.0.1 {name}"), vec!["localhost".into()])?;
        server
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_cert = server
            .signed_by(&server_key, &ca_cert, &ca_key)
            .map_err(tls_error)?;

        let client_key = new_key()?;
        let mut client = params(&format!("edge-outbox client {name}"), Vec::new())?;
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_cert = client
            .signed_by(&client_key, &ca_cert, &ca_key)
            .map_err(tls_error)?;

        for (path, pem) in [
            (&pki.ca_cert, ca_cert.pem()),
            (&pki.ca_key, ca_key.serialize_pem()),
            (&pki.server_cert, server_cert.pem()),
            (&pki.server_key, server_key.serialize_pem()),
            (&pki.client_cert, client_cert.pem()),
            (&pki.client_key, client_key.serialize_pem()),
        ] {
            fs::write(path, pem)?;
        }
        Ok(pki)
    }

    /// A broker TLS listener with this CA and server certificate.
    pub fn listener(&self, require_client_cert: bool) -> TlsListener {
        TlsListener {
            ca: self.ca_cert.clone(),
            cert: self.server_cert.clone(),
            key: self.server_key.clone(),
            require_client_cert,
        }
    }

    pub fn ca_pem(&self) -> io::Result<Vec<u8>> {
        fs::read(&self.ca_cert)
    }

    pub fn client_cert_pem(&self) -> io::Result<Vec<u8>> {
        fs::read(&self.client_cert)
    }

    pub fn client_key_pem(&self) -> io::Result<Vec<u8>> {
        fs::read(&self.client_key)
    }

    /// rumqttc TLS trusting this CA and presenting this client certificate (mutual TLS).
    /// Installs the rustls provider.
    pub fn client_transport(&self) -> io::Result<rumqttc::Transport> {
        install_crypto_provider();
        Ok(rumqttc::Transport::tls(
            self.ca_pem()?,
            Some((self.client_cert_pem()?, self.client_key_pem()?)),
            None,
        ))
    }

    /// rumqttc TLS trusting this CA, without a client certificate. Installs the rustls provider.
    pub fn server_only_transport(&self) -> io::Result<rumqttc::Transport> {
        install_crypto_provider();
        Ok(rumqttc::Transport::tls(self.ca_pem()?, None, None))
    }
}

/// ECDSA P-256, as rustls/webpki and both brokers accept.
fn new_key() -> io::Result<KeyPair> {
    KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(tls_error)
}

/// A leaf or CA certificate's parameters: `common_name`, DNS `names`, signature-only key usage
/// (a CA overrides it), valid from a day ago for two days.
fn params(common_name: &str, names: Vec<String>) -> io::Result<CertificateParams> {
    let mut params = CertificateParams::new(names).map_err(tls_error)?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::days(1);
    params.not_after = now + Duration::days(2);
    Ok(params)
}

fn tls_error(e: rcgen::Error) -> io::Error {
    io::Error::other(format!("generating test certificates: {e}"))
}
