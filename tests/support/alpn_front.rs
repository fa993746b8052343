//! A stand-in for AWS IoT Core's MQTT on port 443: a TLS front (rustls) that requires a client
//! certificate and serves only clients that offer its ALPN protocol (`x-amzn-mqtt-ca`), then
//! forwards the plain MQTT bytes to the test broker. A client that offers no ALPN, or another
//! one, is refused at the handshake and counted, as the cloud refuses it. One thread per
//! connection, each stopped with the front.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::Pki;

/// The running front; stopped (its threads joined) when dropped.
pub struct AlpnFront {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    served: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    accept: Option<JoinHandle<()>>,
}

impl AlpnFront {
    /// Listens on 127.0.0.1 (a port chosen now) with `pki`'s server certificate, trusting its CA
    /// for client certificates, forwarding to `upstream` only clients that offer `protocol`.
    pub fn start(pki: &Pki, protocol: &[u8], upstream: SocketAddr) -> io::Result<AlpnFront> {
        let config = Arc::new(server_config(pki, protocol)?);
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let (stop_a, served_a, refused_a) = (stop.clone(), served.clone(), refused.clone());
        let accept = thread::spawn(move || {
            let mut connections = Vec::new();
            while !stop_a.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let (config, stop) = (config.clone(), stop_a.clone());
                        let (served, refused) = (served_a.clone(), refused_a.clone());
                        connections.push(thread::spawn(move || match handshake(client, config) {
                            Ok((tls, tcp)) => {
                                served.fetch_add(1, Ordering::SeqCst);
                                if let Ok(up) = TcpStream::connect(upstream) {
                                    forward(tls, tcp, up, &stop);
                                }
                            }
                            Err(_) => {
                                refused.fetch_add(1, Ordering::SeqCst);
                            }
                        }));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        thread::sleep(Duration::from_millis(5))
                    }
                    Err(_) => break,
                }
            }
            for c in connections {
                let _ = c.join();
            }
        });
        Ok(AlpnFront {
            addr,
            stop,
            served,
            refused,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Handshakes completed with the protocol offered.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::SeqCst)
    }

    /// Handshakes refused: no ALPN, another protocol, or no valid client certificate.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }
}

impl Drop for AlpnFront {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn server_config(pki: &Pki, protocol: &[u8]) -> io::Result<ServerConfig> {
    let bad = |e: &dyn std::fmt::Display| io::Error::other(e.to_string());
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&pki.ca_cert).map_err(|e| bad(&e))? {
        roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| bad(&e))?;
    let chain = CertificateDer::pem_file_iter(&pki.server_cert)
        .map_err(|e| bad(&e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(&e))?;
    let key = PrivateKeyDer::from_pem_file(&pki.server_key).map_err(|e| bad(&e))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(&e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| bad(&e))?;
    config.alpn_protocols = vec![protocol.to_vec()];
    Ok(config)
}

/// The handshake, refused unless the client offered the front's protocol. rustls refuses a
/// client that offers only other protocols; one that offers none would be served, which the
/// cloud does not do, so that is checked here.
fn handshake(mut tcp: TcpStream, config: Arc<ServerConfig>) -> io::Result<(ServerConnection, TcpStream)> {
    tcp.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut tls = ServerConnection::new(config).map_err(io::Error::other)?;
    while tls.is_handshaking() {
        tls.complete_io(&mut tcp)?;
    }
    if tls.alpn_protocol().is_none() {
        tls.send_close_notify();
        let _ = tls.complete_io(&mut tcp);
        return Err(io::Error::other("the client offered no ALPN protocol"));
    }
    Ok((tls, tcp))
}

/// Copies plain bytes both ways until either side closes or the front stops.
fn forward(mut tls: ServerConnection, mut tcp: TcpStream, mut up: TcpStream, stop: &AtomicBool) {
    if tcp.set_nonblocking(true).is_err() || up.set_nonblocking(true).is_err() {
        return;
    }
    let mut buf = vec![0u8; 16 * 1024];
    let mut to_up: Vec<u8> = Vec::new();
    let would_block = |e: &io::Error| e.kind() == io::ErrorKind::WouldBlock;
    while !stop.load(Ordering::SeqCst) {
        let mut moved = false;
        match tls.read_tls(&mut tcp) {
            Ok(0) => return,
            Ok(_) => {
                moved = true;
                if tls.process_new_packets().is_err() {
                    return;
                }
            }
            Err(e) if would_block(&e) => {}
            Err(_) => return,
        }
        loop {
            match tls.reader().read(&mut buf) {
                Ok(0) => return,
                Ok(n) => to_up.extend_from_slice(&buf[..n]),
                Err(e) if would_block(&e) => break,
                Err(_) => return,
            }
        }
        if !to_up.is_empty() {
            match up.write(&to_up) {
                Ok(n) => {
                    moved = true;
                    to_up.drain(..n);
                }
                Err(e) if would_block(&e) => {}
                Err(_) => return,
            }
        }
        match up.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                moved = true;
                if tls.writer().write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if would_block(&e) => {}
            Err(_) => return,
        }
        while tls.wants_write() {
            match tls.write_tls(&mut tcp) {
                Ok(_) => moved = true,
                Err(e) if would_block(&e) => break,
                Err(_) => return,
            }
        }
        if !moved {
            thread::sleep(Duration::from_millis(1));
        }
    }
}
