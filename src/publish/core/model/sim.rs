//! The model's world: a real store on a real SQLite file, the publishing core driven by hand, and
//! a simulated broker that forwards, acknowledges, refuses, asks for a pause, drops the
//! connection and (on request) loses a message after acknowledging it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rusqlite::Connection;

use crate::mqtt::event::{Cause, CauseKind, Granted, PubAck, Reason, Verdict};
use crate::publish::core::{Action, Core};
use crate::publish::reader::{self, Context};
use crate::publish::{gaps, rows};
use crate::store::epoch::Epochs;
use crate::{Outbox, RelayConfig};

/// A publish on its way to the broker (`answer` is `None`), or received and not answered yet.
pub(super) struct Packet {
    pub pkid: u16,
    pub payload: Vec<u8>,
    pub answer: Option<Answer>,
}

/// What the broker says to a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Answer {
    Accept,
    /// Not authorized (0x87): for good.
    Refuse,
    /// Quota exceeded (0x97): for now.
    Quota,
}

/// The simulated broker, as one connection at a time sees it. It decides what to do with a
/// publish when it receives it, in order, and forwards accepted ones at once, as brokers do; its
/// PUBACKs may go back in any order.
#[derive(Default)]
pub(super) struct Broker {
    pub connected: bool,
    next_pkid: u16,
    pub on_wire: VecDeque<Packet>,
    /// What subscribers got, in order (each a relay's MQTT payload).
    pub forwarded: Vec<Vec<u8>>,
    /// Acknowledged but never forwarded (the broker's own loss), in order.
    pub lost: Vec<Vec<u8>>,
    /// Refused for good (a notice refused cannot be announced: the relay gives up on it, says
    /// so, and the cloud sees those numbers as an unexplained gap).
    pub refused: Vec<Vec<u8>>,
    /// On the wire when a connection ended (or the relay was killed): they may have reached
    /// subscribers or not, and the relay cannot know which.
    pub unsettled: Vec<Vec<u8>>,
    /// Refused for now (quota): published again later, after what the broker accepted behind
    /// them, so their key's order may break there (documented).
    pub postponed: Vec<Vec<u8>>,
    /// The next publish received is lost after it is accepted.
    pub lose_next: bool,
    /// The answer to the next publish received, if not acceptance.
    pub next_answer: Option<Answer>,
}

impl Broker {
    fn send(&mut self, payload: Vec<u8>) -> u16 {
        // Packet ids are never in use twice (rumqttc's collisions are tested elsewhere).
        loop {
            self.next_pkid = self.next_pkid.wrapping_add(1).max(1);
            let id = self.next_pkid;
            if !self.on_wire.iter().any(|p| p.pkid == id) {
                break;
            }
        }
        self.on_wire.push_back(Packet {
            pkid: self.next_pkid,
            payload,
            answer: None,
        });
        self.next_pkid
    }

    /// Everything on its way arrives, in order.
    fn receive(&mut self) {
        for packet in self.on_wire.iter_mut().filter(|p| p.answer.is_none()) {
            let answer = self.next_answer.take().unwrap_or(Answer::Accept);
            if answer == Answer::Accept {
                if std::mem::take(&mut self.lose_next) {
                    self.lost.push(packet.payload.clone());
                } else {
                    self.forwarded.push(packet.payload.clone());
                }
            }
            if answer == Answer::Refuse {
                self.refused.push(packet.payload.clone());
            }
            if answer == Answer::Quota {
                self.postponed.push(packet.payload.clone());
            }
            packet.answer = Some(answer);
        }
    }
}

/// The device: its store, the relay's connection to it, and the core.
pub(super) struct World {
    pub _dir: tempfile::TempDir,
    pub outbox: Outbox,
    pub conn: Connection,
    pub config: RelayConfig,
    pub core: Core,
    pub epochs: Epochs,
    pub broker: Broker,
    /// The simulated monotonic clock, and the simulated wall clock: the real one when the world
    /// was made, moved by every step of time and every jump.
    pub now: Instant,
    wall_base: i64,
    pub wall_shift: i64,
    /// The wall clock the core was last polled with: what it decided by.
    polled_at: i64,
    /// Publishes written to the broker, in order, with the wall clock then: what the expiry
    /// check reads (a queued one is written after its hand-over).
    pub written: Vec<(Vec<u8>, i64)>,
    /// rumqttc's queue: publishes handed over while the broker's receive maximum (`wire_limit`)
    /// were on the wire, written as PUBACKs free their slots, dropped unwritten with the
    /// connection.
    queued: VecDeque<Vec<u8>>,
    wire_limit: Option<usize>,
    /// The core asked for a new connection.
    renew: Option<Cause>,
    /// Batches marked, as the marker counts them.
    marked: u64,
}

impl World {
    pub fn new(options: crate::Options, config: RelayConfig) -> World {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("model.db");
        let outbox = Outbox::open_with(&path, options).expect("store opens");
        let conn = crate::store::connect(&path, outbox.options()).expect("relay connection");
        let epochs = Epochs::read(&conn).expect("epochs");
        World {
            _dir: dir,
            outbox,
            conn,
            core: Core::new(config.clone()),
            config,
            epochs,
            broker: Broker::default(),
            now: Instant::now(),
            wall_base: crate::time::now_ms(),
            wall_shift: 0,
            polled_at: 0,
            written: Vec::new(),
            queued: VecDeque::new(),
            wire_limit: None,
            renew: None,
            marked: 0,
        }
    }

    pub fn now_ms(&self) -> i64 {
        self.wall_base.saturating_add(self.wall_shift)
    }

    /// Performs the core's actions until it has none, as the publisher thread does; rumqttc
    /// writes each publish at its hand-over, or queues it while the broker's receive maximum are
    /// on the wire.
    pub fn drive(&mut self) {
        let mut guard = 0;
        self.polled_at = self.now_ms();
        while let Some(action) = self.core.poll(self.now, self.polled_at) {
            guard += 1;
            assert!(guard < 100_000, "the core keeps asking for work without progress");
            self.perform(action);
        }
        if let Some(mut acked) = self.core.acks_due(true) {
            rows::mark_acked(&mut self.conn, self.outbox.options(), &mut acked).expect("marks");
            self.marked += 1;
            self.core.on_marked(self.marked);
        }
        if let Some(cause) = self.renew.take() {
            // The connection thread closes it: what was written may have reached the broker.
            self.cut(true, &cause);
        }
    }

    fn perform(&mut self, action: Action) {
        match action {
            Action::Publish(p) => {
                if !self.broker.connected {
                    self.core.on_hand_over_failed(p);
                    return;
                }
                if self.wire_limit.is_some_and(|m| self.broker.on_wire.len() >= m) {
                    self.queued.push_back(p.envelope);
                    return;
                }
                self.written.push((p.envelope.clone(), self.polled_at));
                let pkid = self.broker.send(p.envelope);
                self.core.on_published(pkid, self.now);
            }
            Action::Read(req) => {
                let ctx = Context {
                    source: &self.config.source,
                    epochs: &self.epochs,
                    allow_dollar: false,
                    cloud: None,
                    routing: None,
                    format: crate::envelope::EnvelopeFormat::Cbor,
                    ttl: &self.config.ttl,
                    #[cfg(feature = "schemas")]
                    schemas: None,
                };
                match reader::read(&self.conn, &ctx, &req) {
                    Ok(read) => self.core.on_read(read),
                    Err(e) => panic!("the model's read failed: {e}"),
                }
            }
            Action::Claim(seqs) => {
                let gone = rows::claim(&mut self.conn, &seqs).expect("claims");
                self.core.on_claimed(&seqs, &gone);
            }
            Action::MarkAll(mut acked) => {
                if !acked.is_empty() {
                    rows::mark_acked(&mut self.conn, self.outbox.options(), &mut acked).expect("marks");
                    self.marked += 1;
                }
            }
            Action::Announced(ranges) => {
                gaps::mark_announced(&mut self.conn, self.outbox.options(), &ranges)
                    .expect("marks announced");
            }
            Action::DeadLetter(bad, _) => {
                rows::dead_letter(&mut self.conn, &bad).expect("dead letters");
                self.core.on_change();
            }
            Action::Expire(mut seqs) => {
                rows::expire(&mut self.conn, &mut seqs).expect("expires");
                self.core.on_change();
            }
            Action::Renew(cause) => self.renew = Some(cause),
            Action::Report(_) => {}
        }
    }

    pub fn connect(&mut self, receive_max: Option<u16>) {
        if self.broker.connected {
            return;
        }
        self.broker.connected = true;
        self.wire_limit = receive_max.map(|m| usize::from(m).max(1));
        let granted = Granted {
            receive_max,
            ..Granted::default()
        };
        self.core.on_connected(&granted, self.now);
        self.drive();
    }

    /// The broker receives what is on its way, and answers the `pick`-th packet on the wire.
    pub fn answer(&mut self, pick: usize) {
        self.broker.receive();
        if self.broker.on_wire.is_empty() {
            return;
        }
        let at = pick % self.broker.on_wire.len();
        let Some(packet) = self.broker.on_wire.remove(at) else {
            return;
        };
        let verdict = match packet.answer {
            Some(Answer::Refuse) => Verdict::Refused(Reason::new(0x87, None)),
            Some(Answer::Quota) => Verdict::Later(Reason::new(0x97, None)),
            Some(Answer::Accept) | None => Verdict::Accepted,
        };
        let ack = PubAck {
            pkid: packet.pkid,
            verdict,
        };
        self.core.on_puback(ack, self.now);
        // The freed slot takes the next queued publish before anything handed over after this.
        if let Some(next) = self.queued.pop_front() {
            self.written.push((next.clone(), self.now_ms()));
            let pkid = self.broker.send(next);
            self.core.on_published(pkid, self.now);
        }
        self.drive();
    }

    /// The connection ends: with `arrived`, what was on its way reached the broker first; else
    /// it was lost on the way. A broker that closes over a packet takes nothing more.
    pub fn cut(&mut self, arrived: bool, cause: &Cause) {
        if !self.broker.connected {
            return;
        }
        let mut cause = cause.clone();
        if cause.kind == CauseKind::NamesPacket {
            // It names the oldest packet on the wire, which it did not take; one it took already
            // cannot be named, so the connection is just lost.
            if self.broker.on_wire.front().is_some_and(|p| p.answer.is_some()) {
                cause.kind = CauseKind::Lost;
            }
        } else if arrived {
            self.broker.receive();
        }
        self.end_connection();
        self.core.on_disconnected(&cause, self.now);
        self.drive();
    }

    fn end_connection(&mut self) {
        self.broker.connected = false;
        // Never written: the broker never saw them.
        self.queued.clear();
        for packet in std::mem::take(&mut self.broker.on_wire) {
            self.broker.unsettled.push(packet.payload);
        }
    }

    /// Wakes the core as the publisher does when its timer falls due, until its next deadline
    /// lies ahead. One that stays at or before now is a driver waking at once, again and again,
    /// with nothing to do: a spinning thread on a device.
    pub fn settle_timers(&mut self) -> Result<(), String> {
        for _ in 0..3 {
            match self.core.next_timeout() {
                Some(due) if due <= self.now => {
                    self.core.on_tick(self.now);
                    self.core.on_idle();
                    self.drive();
                }
                _ => return Ok(()),
            }
        }
        let late = self
            .core
            .next_timeout()
            .map_or(Duration::ZERO, |due| self.now.duration_since(due));
        Err(format!(
            "the core asks to be woken at a deadline {late:?} gone by, again and again, with \
             nothing to do"
        ))
    }

    pub fn advance(&mut self, by: Duration) {
        self.now += by;
        self.wall_shift = self.wall_shift.saturating_add(crate::time::ms(by));
        self.core.on_tick(self.now);
        self.core.on_idle();
        self.core.on_change();
        self.drive();
    }

    /// The relay is killed and started again: everything in memory is gone, the file stays.
    pub fn restart(&mut self, arrived: bool) {
        if arrived {
            self.broker.receive();
        }
        self.end_connection();
        self.renew = None;
        self.core = Core::new(self.config.clone());
        self.marked = 0;
        self.epochs = Epochs::read(&self.conn).expect("epochs");
    }
}
