//! One address for both MQTT versions in front of rumqttd, which serves 3.1.1 and 5 on separate
//! listeners (mosquitto serves both on one): it reads the CONNECT's protocol level and forwards
//! the connection to the matching listener, bytes unchanged. So `Broker::addr()` works for a
//! client of either version, as it does with mosquitto, and a test never has to pick.
//!
//! Std threads: one accept thread, two pumps per connection, all joined on drop.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// How long a new connection may take to send the start of its CONNECT.
const SNIFF_TIMEOUT: Duration = Duration::from_secs(10);

pub struct ProtocolMux {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

struct Shared {
    v4: SocketAddr,
    v5: SocketAddr,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    shutdown: bool,
    next_id: u64,
    /// Both sockets of every open connection, to shut them down on drop.
    sockets: HashMap<u64, [TcpStream; 2]>,
    threads: Vec<JoinHandle<()>>,
}

impl ProtocolMux {
    /// Listens on 127.0.0.1 (port picked at run time): MQTT 3.1.1 (and 3.1) clients go to `v4`,
    /// MQTT 5 clients to `v5`.
    pub fn start(v4: SocketAddr, v5: SocketAddr) -> io::Result<ProtocolMux> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            v4,
            v5,
            state: Mutex::new(State::default()),
        });
        let acceptor = {
            let shared = shared.clone();
            thread::Builder::new()
                .name(format!("mqtt-mux-{}", addr.port()))
                .spawn(move || accept_loop(&listener, &shared))?
        };
        Ok(ProtocolMux {
            addr,
            shared,
            acceptor: Some(acceptor),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for ProtocolMux {
    fn drop(&mut self) {
        {
            let mut st = self.shared.lock();
            st.shutdown = true;
            for pair in st.sockets.values() {
                for s in pair {
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
        }
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let threads = std::mem::take(&mut self.shared.lock().threads);
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    loop {
        let accepted = listener.accept();
        if shared.lock().shutdown {
            return;
        }
        let Ok((client, _)) = accepted else {
            thread::sleep(Duration::from_millis(50));
            continue;
        };
        let shared2 = shared.clone();
        let handle = thread::Builder::new()
            .name("mqtt-mux-conn".into())
            .spawn(move || serve(client, &shared2));
        let mut st = shared.lock();
        // Reap finished connection threads so a long test does not pile them up.
        let (done, running): (Vec<_>, Vec<_>) = st.threads.drain(..).partition(|t| t.is_finished());
        st.threads = running;
        if let Ok(h) = handle {
            st.threads.push(h);
        }
        drop(st);
        for t in done {
            let _ = t.join();
        }
    }
}

fn serve(mut client: TcpStream, shared: &Shared) {
    let _ = client.set_read_timeout(Some(SNIFF_TIMEOUT));
    let Ok((head, level)) = sniff(&mut client) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = client.set_read_timeout(None);
    let target = if level == 5 { shared.v5 } else { shared.v4 };
    let Ok(mut upstream) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    if upstream.write_all(&head).is_err() {
        return;
    }
    let (Ok(c2), Ok(u2)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    let id = {
        let mut st = shared.lock();
        if st.shutdown {
            return;
        }
        let id = st.next_id;
        st.next_id += 1;
        if let (Ok(a), Ok(b)) = (client.try_clone(), upstream.try_clone()) {
            st.sockets.insert(id, [a, b]);
        }
        id
    };
    let down = thread::Builder::new()
        .name("mqtt-mux-down".into())
        .spawn(move || pump(u2, c2));
    pump(client.try_clone().unwrap_or(client), upstream);
    if let Ok(d) = down {
        let _ = d.join();
    }
    shared.lock().sockets.remove(&id);
}

/// Reads until the CONNECT's protocol level is known; returns the bytes read and the level.
fn sniff(client: &mut TcpStream) -> io::Result<(Vec<u8>, u8)> {
    let mut head = Vec::with_capacity(16);
    let mut buf = [0u8; 64];
    loop {
        if let Some(level) = protocol_level(&head)? {
            return Ok((head, level));
        }
        let n = client.read(&mut buf)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&buf[..n]);
    }
}

/// The protocol level of a CONNECT that starts `bytes`, once enough of it is there.
fn protocol_level(bytes: &[u8]) -> io::Result<Option<u8>> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "not an MQTT CONNECT");
    let Some(&first) = bytes.first() else {
        return Ok(None);
    };
    if first != 0x10 {
        return Err(bad());
    }
    // Remaining length: 1 to 4 bytes, 7 bits each.
    let mut i = 1;
    loop {
        let Some(&b) = bytes.get(i) else { return Ok(None) };
        i += 1;
        if b & 0x80 == 0 {
            break;
        }
        if i > 4 {
            return Err(bad());
        }
    }
    // Protocol name: a 2-byte length, then the name ("MQTT", or "MQIsdp" for 3.1).
    let (Some(&hi), Some(&lo)) = (bytes.get(i), bytes.get(i + 1)) else {
        return Ok(None);
    };
    let name_len = usize::from(u16::from_be_bytes([hi, lo]));
    Ok(bytes.get(i + 2 + name_len).copied())
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}
