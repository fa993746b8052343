//! A TCP proxy on 127.0.0.1 between a client and the broker, to break the network on command.
//!
//! Std threads only: one accept thread, two pump threads per connection (one per direction), all
//! joined on drop. Nothing polls: pumps block in `read`/`write` or on a condvar, and every command
//! wakes them (`shutdown` on the sockets, `notify_all` on the condvar, a self-connect for `accept`).
//!
//! | command          | current connections                         | new connections            |
//! |------------------|---------------------------------------------|----------------------------|
//! | `cut()`          | closed at once, both sides                  | unaffected                 |
//! | `stall()`        | kept open, no byte forwarded either way     | accepted, stalled too      |
//! | `resume()`       | held bytes forwarded, forwarding resumes    | forwarded                  |
//! | `refuse(true)`   | unaffected (combine with `cut()`)           | accepted, then closed      |
//! | `half_open()`    | bytes dropped both ways, client socket kept | unaffected                 |
//!
//! As an HTTP proxy (`Proxy::http_connect`), it enforces what a corporate proxy does before it
//! forwards a byte: the client must open with `CONNECT host:port HTTP/1.1` naming the one target
//! it allows (403 otherwise) and, if it requires basic authentication, carry the right
//! `Proxy-Authorization` (407 otherwise); only then does it answer 200 and start forwarding. The
//! target's name need not resolve anywhere: only the proxy knows where it is, so a client that
//! does not go through the proxy cannot reach the broker at all.
//!
//! `half_open()` is a dead route: the client's writes succeed, nothing comes back and no FIN or
//! RST arrives, so the client finds out only through its keep-alive (no PINGRESP). The broker side
//! is likewise left to time out on its own keep-alive (1.5x the client's).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Bound on connecting to the upstream broker for each accepted client.
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

/// What an HTTP CONNECT proxy requires before it opens a tunnel.
#[derive(Clone, Debug)]
pub struct ConnectRule {
    /// The only `host:port` it tunnels to (to the proxy's upstream).
    pub target: String,
    /// Basic authentication it requires, if any.
    pub basic_auth: Option<(String, String)>,
}

struct Shared {
    upstream: SocketAddr,
    connect_rule: Option<ConnectRule>,
    state: Mutex<State>,
    /// Signalled on every change of `State` (commands, new connections, closed connections).
    changed: Condvar,
}

#[derive(Default)]
struct State {
    shutdown: bool,
    stalled: bool,
    refusing: bool,
    accepted: u64,
    forwarded: u64,
    /// HTTP CONNECT requests answered 403 (another target, or not a CONNECT) and 407 (no or
    /// wrong credentials).
    refused_target: u64,
    refused_auth: u64,
    bytes_to_broker: u64,
    bytes_to_client: u64,
    next_id: u64,
    conns: HashMap<u64, Conn>,
    pumps: Vec<JoinHandle<()>>,
}

struct Conn {
    client: TcpStream,
    upstream: TcpStream,
    cut: bool,
    half_open: bool,
    /// Pumps still running; the last one out removes the connection.
    pumps: u8,
}

impl Conn {
    fn close(&mut self) {
        self.cut = true;
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.upstream.shutdown(Shutdown::Both);
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Direction {
    ToBroker,
    ToClient,
}

impl Proxy {
    /// Listens on 127.0.0.1 (port picked at run time) and forwards to `upstream`.
    pub fn start(upstream: SocketAddr) -> io::Result<Proxy> {
        Self::listen(0, upstream, None)
    }

    /// An HTTP proxy on 127.0.0.1 that tunnels `CONNECT rule.target` to `upstream` (see the
    /// module's docs). `port` 0 picks one; another port starts it again where a stopped one was.
    pub fn http_connect(port: u16, upstream: SocketAddr, rule: ConnectRule) -> io::Result<Proxy> {
        Self::listen(port, upstream, Some(rule))
    }

    fn listen(port: u16, upstream: SocketAddr, connect_rule: Option<ConnectRule>) -> io::Result<Proxy> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            connect_rule,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let acceptor = {
            let shared = shared.clone();
            thread::Builder::new()
                .name(format!("proxy-accept-{}", addr.port()))
                .spawn(move || accept_loop(listener, shared))?
        };
        Ok(Proxy {
            addr,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Closes every current connection, both sides, at once (FIN both ways: std cannot send RST).
    /// Bytes held by a stall are dropped.
    pub fn cut(&self) {
        let mut st = self.shared.lock();
        for c in st.conns.values_mut() {
            c.close();
        }
        drop(st);
        self.shared.changed.notify_all();
    }

    /// Stops forwarding in both directions, keeping every connection open; also applies to
    /// connections accepted while stalled. Bytes read meanwhile are held until `resume()`.
    pub fn stall(&self) {
        self.shared.lock().stalled = true;
        self.shared.changed.notify_all();
    }

    /// Forwards held bytes and resumes forwarding.
    pub fn resume(&self) {
        self.shared.lock().stalled = false;
        self.shared.changed.notify_all();
    }

    /// `true`: new connections are accepted and closed at once (the broker looks down).
    /// Existing connections are left alone: `refuse(true)` then `cut()` for a full outage.
    pub fn refuse(&self, on: bool) {
        self.shared.lock().refusing = on;
        self.shared.changed.notify_all();
    }

    /// Turns every current connection into a dead route (see the module docs); new connections
    /// are forwarded normally. Ends with the client closing its socket, a `cut()` or drop.
    pub fn half_open(&self) {
        let mut st = self.shared.lock();
        for c in st.conns.values_mut() {
            c.half_open = true;
        }
        drop(st);
        self.shared.changed.notify_all();
    }

    /// TCP connections accepted so far, including refused ones and ones whose upstream connect
    /// failed.
    /// HTTP CONNECT requests refused: (wrong target or not a CONNECT, wrong or no credentials).
    pub fn refused_connects(&self) -> (u64, u64) {
        let st = self.shared.lock();
        (st.refused_target, st.refused_auth)
    }

    pub fn accepted(&self) -> u64 {
        self.shared.lock().accepted
    }

    /// Connections accepted and connected to the broker so far.
    pub fn forwarded(&self) -> u64 {
        self.shared.lock().forwarded
    }

    /// Bytes forwarded from clients to the broker so far, over all connections.
    pub fn bytes_to_broker(&self) -> u64 {
        self.shared.lock().bytes_to_broker
    }

    /// Bytes forwarded from the broker to clients so far, over all connections.
    pub fn bytes_to_client(&self) -> u64 {
        self.shared.lock().bytes_to_client
    }

    /// Waits until `bytes_to_broker() >= n`; false on timeout. With `cut()`, cuts in the middle of
    /// a transfer: `wait_bytes_to_broker(proxy.bytes_to_broker() + 50_000, WAIT)`.
    pub fn wait_bytes_to_broker(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.bytes_to_broker >= n)
    }

    /// Waits until `bytes_to_client() >= n`; false on timeout.
    pub fn wait_bytes_to_client(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.bytes_to_client >= n)
    }

    /// Connections open right now (including half-open ones).
    pub fn active(&self) -> usize {
        self.shared.lock().conns.len()
    }

    /// Waits until `forwarded() >= n` (connections, not bytes); false on timeout. Use it to see a
    /// client reconnect: `wait_forwarded(proxy.forwarded() + 1, WAIT)` after a `cut()`.
    pub fn wait_forwarded(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.forwarded >= n)
    }

    /// Waits until `accepted() >= n`; false on timeout.
    pub fn wait_accepted(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.accepted >= n)
    }

    /// Waits until `active() == n`; false on timeout.
    pub fn wait_active(&self, n: usize, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.conns.len() == n)
    }

    fn wait_until(&self, timeout: Duration, mut done: impl FnMut(&State) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        loop {
            if done(&st) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("stalled", &st.stalled)
            .field("refusing", &st.refusing)
            .field("accepted", &st.accepted)
            .field("forwarded", &st.forwarded)
            .field("active", &st.conns.len())
            .finish()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        {
            let mut st = self.shared.lock();
            st.shutdown = true;
            for c in st.conns.values_mut() {
                c.close();
            }
        }
        self.shared.changed.notify_all();
        // Wake the blocking accept; it sees `shutdown` and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let pumps = std::mem::take(&mut self.shared.lock().pumps);
        for p in pumps {
            let _ = p.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking pump must not take the whole harness down with poisoned locks.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let accepted = listener.accept();
        let mut st = shared.lock();
        if st.shutdown {
            return;
        }
        let client = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                drop(st);
                eprintln!("proxy: accept failed: {e}");
                // E.g. out of file descriptors: do not spin.
                thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        st.accepted += 1;
        // Reap pumps that already finished so a long test with many cuts does not pile them up.
        let (done, running): (Vec<_>, Vec<_>) = st.pumps.drain(..).partition(|p| p.is_finished());
        st.pumps = running;
        let refusing = st.refusing;
        drop(st);
        shared.changed.notify_all();
        for p in done {
            let _ = p.join();
        }
        if refusing {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        if let Some(rule) = &shared.connect_rule {
            match http_connect(&client, rule) {
                Ok(Tunnel::Open) => {}
                Ok(refused) => {
                    let mut st = shared.lock();
                    match refused {
                        Tunnel::Forbidden => st.refused_target += 1,
                        _ => st.refused_auth += 1,
                    }
                    drop(st);
                    shared.changed.notify_all();
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                Err(_) => {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
            }
        }
        let upstream = match TcpStream::connect_timeout(&shared.upstream, UPSTREAM_CONNECT_TIMEOUT) {
            Ok(u) => u,
            Err(_) => {
                // Broker down: the client sees its connection closed, as with a refused connect
                // (through an HTTP proxy, after a 502).
                if shared.connect_rule.is_some() {
                    let _ = (&client).write_all(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n");
                }
                let _ = client.shutdown(Shutdown::Both);
                continue;
            }
        };
        if shared.connect_rule.is_some()
            && (&client)
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .is_err()
        {
            continue;
        }
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        if let Err(e) = spawn_pumps(&shared, client, upstream) {
            eprintln!("proxy: cannot start pumps: {e}");
        }
    }
}

fn spawn_pumps(shared: &Arc<Shared>, client: TcpStream, upstream: TcpStream) -> io::Result<()> {
    let handles = [
        (client.try_clone()?, upstream.try_clone()?, Direction::ToBroker),
        (upstream.try_clone()?, client.try_clone()?, Direction::ToClient),
    ];
    let mut st = shared.lock();
    if st.shutdown {
        return Ok(());
    }
    let id = st.next_id;
    st.next_id += 1;
    st.forwarded += 1;
    st.conns.insert(
        id,
        Conn {
            client,
            upstream,
            cut: false,
            half_open: false,
            pumps: 2,
        },
    );
    for (from, to, dir) in handles {
        let shared2 = shared.clone();
        let name = format!(
            "proxy-{id}-{}",
            if dir == Direction::ToBroker { "up" } else { "down" }
        );
        match thread::Builder::new()
            .name(name)
            .spawn(move || pump(&shared2, id, from, to, dir))
        {
            Ok(h) => st.pumps.push(h),
            Err(e) => {
                if let Some(c) = st.conns.get_mut(&id) {
                    c.close();
                    c.pumps -= 1;
                    if c.pumps == 0 {
                        st.conns.remove(&id);
                    }
                }
                drop(st);
                shared.changed.notify_all();
                return Err(e);
            }
        }
    }
    drop(st);
    shared.changed.notify_all();
    Ok(())
}

/// What the pump does after a read, decided under the lock.
enum Next {
    Forward,
    Discard,
    Stop,
}

fn pump(shared: &Shared, id: u64, mut from: TcpStream, mut to: TcpStream, dir: Direction) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // `None`: the peer closed (EOF); `Some(Err)`: the socket failed or was shut down by us.
        let read = match from.read(&mut buf) {
            Ok(0) => None,
            Ok(n) => Some(Ok(n)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Some(Err(e)),
        };
        let next = {
            let mut st = shared.lock();
            loop {
                let Some(c) = st.conns.get(&id) else {
                    break Next::Stop;
                };
                if st.shutdown || c.cut {
                    break Next::Stop;
                }
                if c.half_open {
                    break Next::Discard;
                }
                if !st.stalled {
                    // Counted when decided, under the lock `stall()` takes: once `stall()` has
                    // returned, the counters stand still.
                    if let Some(Ok(n)) = read {
                        match dir {
                            Direction::ToBroker => st.bytes_to_broker += n as u64,
                            Direction::ToClient => st.bytes_to_client += n as u64,
                        }
                        shared.changed.notify_all();
                    }
                    break Next::Forward;
                }
                // Stalled: hold what was read (EOF included) until resume, cut or drop.
                st = shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        match (next, read) {
            (Next::Stop, _) => break,
            (Next::Discard, Some(Ok(_))) => continue,
            // A dead route reports nothing: no FIN towards the client. When the client itself
            // closes, the connection is over; when the broker does, keep the client hanging.
            (Next::Discard, _) => {
                if dir == Direction::ToBroker {
                    close_conn(shared, id);
                }
                break;
            }
            (Next::Forward, Some(Ok(n))) => {
                if to.write_all(&buf[..n]).is_err() {
                    close_conn(shared, id);
                    break;
                }
            }
            (Next::Forward, None) => {
                // Orderly close: pass the FIN on, keep the other direction running.
                let _ = to.shutdown(Shutdown::Write);
                break;
            }
            (Next::Forward, Some(Err(_))) => {
                close_conn(shared, id);
                break;
            }
        }
    }
    let mut st = shared.lock();
    if let Some(c) = st.conns.get_mut(&id) {
        c.pumps -= 1;
        if c.pumps == 0 {
            c.close();
            st.conns.remove(&id);
        }
    }
    drop(st);
    shared.changed.notify_all();
}

fn close_conn(shared: &Shared, id: u64) {
    if let Some(c) = shared.lock().conns.get_mut(&id) {
        c.close();
    }
    shared.changed.notify_all();
}

enum Tunnel {
    Open,
    Forbidden,
    Unauthorized,
}

/// Reads the client's request head and answers a refusal as the rule says: 403 or 407. Reads byte by byte up to the blank line, so nothing of the tunnel's own bytes is
/// consumed here.
fn http_connect(mut client: &TcpStream, rule: &ConnectRule) -> io::Result<Tunnel> {
    client.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 8192 || client.read(&mut byte)? == 0 {
            return Ok(Tunnel::Forbidden);
        }
        head.push(byte[0]);
    }
    client.set_read_timeout(None)?;
    let head = String::from_utf8_lossy(&head);
    let mut lines = head.split("\r\n");
    let request = lines.next().unwrap_or("");
    let verdict = if request != format!("CONNECT {} HTTP/1.1", rule.target) {
        Tunnel::Forbidden
    } else if let Some((user, password)) = &rule.basic_auth {
        let expected = format!("basic {}", base64(format!("{user}:{password}").as_bytes()));
        let given = lines.find_map(|line| {
            line.split_once(':')
                .filter(|(name, _)| name.eq_ignore_ascii_case("proxy-authorization"))
                .map(|(_, value)| value.trim().to_owned())
        });
        // The scheme's name is case-insensitive (RFC 9110), the credentials are not.
        let matches = given.is_some_and(|g| {
            g.len() == expected.len() && g[..6].eq_ignore_ascii_case("basic ") && g[6..] == expected[6..]
        });
        if matches {
            Tunnel::Open
        } else {
            Tunnel::Unauthorized
        }
    } else {
        Tunnel::Open
    };
    let answer: &[u8] = match verdict {
        // Answered once the upstream connection stands (200) or failed (502).
        Tunnel::Open => return Ok(verdict),
        Tunnel::Forbidden => b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n",
        Tunnel::Unauthorized => {
            b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"proxy\"\r\nContent-Length: 0\r\n\r\n"
        }
    };
    client.write_all(answer)?;
    Ok(verdict)
}

/// Standard base64 with padding (RFC 4648), for the expected `Proxy-Authorization`.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
