//! Certificates generated at run time with the `openssl` command-line tool: a CA, a server
//! certificate for `127.0.0.1` and `localhost`, and a client certificate, all ECDSA P-256, valid
//! for two days, with the extensions rustls/webpki insist on (v3, CA basic constraints, key usage,
//! extended key usage, subject alternative names).
//!
//! Two `Pki::generate` calls give two unrelated CAs: trust one, connect to a broker using the
//! other, and the handshake must fail.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use super::broker::TlsListener;

/// Whether `openssl` runs here (Debian: package `openssl`).
pub fn openssl_available() -> bool {
    Command::new("openssl")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

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

const OPENSSL_CNF: &str = "\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
";

impl Pki {
    /// Writes a new CA, server and client certificate into `dir` (created if missing). `name`
    /// goes into the subjects, to tell CAs apart in logs. Fails with `NotFound` without `openssl`.
    pub fn generate(dir: &Path, name: &str) -> io::Result<Pki> {
        if !openssl_available() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the `openssl` command is needed to generate test certificates (Debian: apt install openssl)",
            ));
        }
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
        let cnf = p("openssl.cnf");
        fs::write(&cnf, OPENSSL_CNF)?;

        for key in [&pki.ca_key, &pki.server_key, &pki.client_key] {
            run(openssl([
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
            ])
            .arg(key))?;
        }
        run(openssl([
            "req",
            "-new",
            "-x509",
            "-extensions",
            "ca_ext",
            "-days",
            "2",
            "-config",
        ])
        .arg(&cnf)
        .arg("-key")
        .arg(&pki.ca_key)
        .arg("-subj")
        .arg(format!("/CN=edge-outbox test CA {name}"))
        .arg("-out")
        .arg(&pki.ca_cert))?;
        pki.sign(
            &cnf,
            &pki.server_key,
            &pki.server_cert,
            &format!("/CN=127.0.0.1 {name}"),
            "server_ext",
        )?;
        pki.sign(
            &cnf,
            &pki.client_key,
            &pki.client_cert,
            &format!("/CN=edge-outbox client {name}"),
            "client_ext",
        )?;
        let _ = fs::remove_file(p("server.csr"));
        let _ = fs::remove_file(p("client.csr"));
        Ok(pki)
    }

    fn sign(&self, cnf: &Path, key: &Path, cert: &Path, subject: &str, ext: &str) -> io::Result<()> {
        let csr = cert.with_extension("csr");
        run(openssl(["req", "-new", "-config"])
            .arg(cnf)
            .arg("-key")
            .arg(key)
            .arg("-subj")
            .arg(subject)
            .arg("-out")
            .arg(&csr))?;
        // A random serial: two certificates with the same issuer and serial confuse verifiers.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let serial = format!("0x{:x}{:04x}", nanos, std::process::id() & 0xffff);
        run(openssl([
            "x509",
            "-req",
            "-days",
            "2",
            "-extensions",
            ext,
            "-set_serial",
            &serial,
            "-in",
        ])
        .arg(&csr)
        .arg("-CA")
        .arg(&self.ca_cert)
        .arg("-CAkey")
        .arg(&self.ca_key)
        .arg("-extfile")
        .arg(cnf)
        .arg("-out")
        .arg(cert))
    }

    /// A mosquitto TLS listener with this CA and server certificate.
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

fn openssl<'a>(args: impl IntoIterator<Item = &'a str>) -> Command {
    let mut cmd = Command::new("openssl");
    cmd.args(args).stdin(Stdio::null());
    cmd
}

fn run(cmd: &mut Command) -> io::Result<()> {
    let out = cmd.output()?;
    if out.status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    )))
}
