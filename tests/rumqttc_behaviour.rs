//! What the relay relies on in rumqttc, one test per behaviour, so that an upgrade that changes
//! one fails here instead of losing messages. rumqttc is pinned to `=0.25.1` in Cargo.toml; bump
//! it only with these passing (and read docs/reliability.md, "What the relay relies on in rumqttc", again).
//!
//! Each test drives a bare rumqttc client (3.1.1 and 5) against a broker, through the
//! MQTT-aware proxy where the broker must misbehave. These tests are about the client, so they
//! take mosquitto when it is installed, whatever `EDGE_OUTBOX_BROKER` says: rumqttd 0.20 now and
//! then aborts one of these connections under load (seen here in one run of three of this file,
//! MQTT 5, with nothing in its log), which would read as a change in rumqttc.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rumqttc::v5::mqttbytes::v5 as v5p;
use support::{Broker, BrokerKind, MqttProxy, WAIT};

/// mosquitto if installed, else the environment's broker (see the module docs).
fn client_test_broker() -> Broker {
    let builder = Broker::builder();
    let builder = if support::broker::mosquitto_path().is_some() {
        builder.kind(BrokerKind::Mosquitto)
    } else {
        builder
    };
    builder.start().expect("broker")
}

/// What a client saw, in order, reduced to what the relay acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    ConnAck {
        max_packet: Option<u32>,
        receive_max: Option<u16>,
    },
    Publish(u16),
    AwaitAck(u16),
    PubAck {
        pkid: u16,
        reason: u8,
    },
    Disconnect,
    Error(String),
}

fn v4_client(addr: SocketAddr, id: &str, inflight: u16) -> (rumqttc::Client, rumqttc::Connection) {
    let mut o = rumqttc::MqttOptions::new(id, addr.ip().to_string(), addr.port());
    o.set_keep_alive(Duration::from_secs(5)).set_inflight(inflight);
    rumqttc::Client::new(o, 1000)
}

fn v5_client(addr: SocketAddr, id: &str, inflight: u16) -> (rumqttc::v5::Client, rumqttc::v5::Connection) {
    let mut o = rumqttc::v5::MqttOptions::new(id, addr.ip().to_string(), addr.port());
    o.set_keep_alive(Duration::from_secs(5))
        .set_outgoing_inflight_upper_limit(inflight);
    rumqttc::v5::Client::new(o, 1000)
}

fn seen_v4(e: Result<rumqttc::Event, rumqttc::ConnectionError>) -> Option<Seen> {
    use rumqttc::{Event, Outgoing, Packet};
    Some(match e {
        Ok(Event::Incoming(Packet::ConnAck(_))) => Seen::ConnAck {
            max_packet: None,
            receive_max: None,
        },
        Ok(Event::Incoming(Packet::PubAck(a))) => Seen::PubAck {
            pkid: a.pkid,
            reason: 0,
        },
        Ok(Event::Outgoing(Outgoing::Publish(p))) => Seen::Publish(p),
        Ok(Event::Outgoing(Outgoing::AwaitAck(p))) => Seen::AwaitAck(p),
        Ok(Event::Outgoing(Outgoing::Disconnect)) => Seen::Disconnect,
        Ok(_) => return None,
        Err(e) => Seen::Error(format!("{e:?}")),
    })
}

fn seen_v5(e: Result<rumqttc::v5::Event, rumqttc::v5::ConnectionError>) -> Option<Seen> {
    use rumqttc::Outgoing;
    use rumqttc::v5::Event;
    Some(match e {
        Ok(Event::Incoming(v5p::Packet::ConnAck(a))) => Seen::ConnAck {
            max_packet: a.properties.as_ref().and_then(|p| p.max_packet_size),
            receive_max: a.properties.as_ref().and_then(|p| p.receive_max),
        },
        Ok(Event::Incoming(v5p::Packet::PubAck(a))) => Seen::PubAck {
            pkid: a.pkid,
            reason: match a.reason {
                v5p::PubAckReason::Success => 0,
                v5p::PubAckReason::NoMatchingSubscribers => 0x10,
                v5p::PubAckReason::NotAuthorized => 0x87,
                v5p::PubAckReason::QuotaExceeded => 0x97,
                _ => 0xff,
            },
        },
        Ok(Event::Outgoing(Outgoing::Publish(p))) => Seen::Publish(p),
        Ok(Event::Outgoing(Outgoing::AwaitAck(p))) => Seen::AwaitAck(p),
        Ok(Event::Outgoing(Outgoing::Disconnect)) => Seen::Disconnect,
        Ok(_) => return None,
        Err(e) => Seen::Error(format!("{e:?}")),
    })
}

/// Polls until `done` holds for what was seen (or an error, or WAIT).
fn collect(mut next: impl FnMut() -> Option<Seen>, mut done: impl FnMut(&[Seen]) -> bool) -> Vec<Seen> {
    let deadline = Instant::now() + WAIT;
    let mut seen = Vec::new();
    while !done(&seen) {
        assert!(Instant::now() < deadline, "timed out; seen so far: {seen:?}");
        if let Some(s) = next() {
            let error = matches!(s, Seen::Error(_));
            seen.push(s);
            if error {
                break;
            }
        }
    }
    seen
}

/// `next`, except that a connection that fails before its first publish is reported on stderr
/// and tried again (rumqttc reconnects at the next poll), up to 3 times: an emulated test
/// process is slow enough for a connection setup to fail, which is not what the tests using it
/// are about. Nothing was handed over yet, so the packet ids and the order are a fresh start.
fn through_failed_connects(mut next: impl FnMut() -> Option<Seen>) -> impl FnMut() -> Option<Seen> {
    let (mut published, mut failed) = (false, 0);
    move || match next() {
        Some(Seen::Error(e)) if !published && failed < 3 => {
            failed += 1;
            eprintln!("rumqttc_behaviour: the connection failed before any publish ({e}); trying again");
            None
        }
        Some(s) => {
            published |= matches!(s, Seen::Publish(_));
            Some(s)
        }
        None => None,
    }
}

fn count(seen: &[Seen], f: impl Fn(&Seen) -> bool) -> usize {
    seen.iter().filter(|s| f(s)).count()
}

/// The tracker's first assumption: each QoS 1 request yields one `Outgoing::Publish(pkid)`, in
/// request order, packet ids cycling 1..=the in-flight limit. Checked against what went on the
/// wire (the proxy records each PUBLISH with its packet id and payload).
#[test]
fn publish_events_come_in_request_order_with_ids_cycling_up_to_the_inflight_limit() {
    let broker = client_test_broker();
    for v5 in [false, true] {
        let proxy = MqttProxy::start(broker.addr()).expect("proxy");
        proxy.record_publishes(true);
        let payloads: Vec<Vec<u8>> = (0..23u8).map(|i| vec![i]).collect();
        let seen = if v5 {
            let (client, mut conn) = v5_client(proxy.addr(), "order-v5", 5);
            for p in &payloads {
                client
                    .publish(
                        "pin/order",
                        rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                        false,
                        p.clone(),
                    )
                    .expect("publish");
            }
            collect(
                through_failed_connects(|| conn.recv().ok().and_then(seen_v5)),
                |s| count(s, |x| matches!(x, Seen::PubAck { .. })) >= 23,
            )
        } else {
            let (client, mut conn) = v4_client(proxy.addr(), "order-v4", 5);
            for p in &payloads {
                client
                    .publish("pin/order", rumqttc::QoS::AtLeastOnce, false, p.clone())
                    .expect("publish");
            }
            collect(
                through_failed_connects(|| conn.recv().ok().and_then(seen_v4)),
                |s| count(s, |x| matches!(x, Seen::PubAck { .. })) >= 23,
            )
        };
        let ids: Vec<u16> = seen
            .iter()
            .filter_map(|s| match s {
                Seen::Publish(p) => Some(*p),
                _ => None,
            })
            .collect();
        let want: Vec<u16> = (0..23).map(|i| (i % 5) as u16 + 1).collect();
        assert_eq!(ids, want, "v5={v5}; seen: {seen:?}");
        let wire: Vec<(u16, Vec<u8>)> = proxy
            .recorded()
            .into_iter()
            .map(|p| (p.pkid, p.payload))
            .collect();
        let expected: Vec<(u16, Vec<u8>)> = want.iter().copied().zip(payloads.iter().cloned()).collect();
        assert_eq!(wire, expected, "v5={v5}: the n-th event is the n-th request");
    }
}

/// The tracker's second assumption: a collision (acks out of order with the window full) is
/// reported as `AwaitAck(id)` for the next request, which goes out later with `Publish(id)`
/// once that id's PUBACK arrives.
#[test]
fn a_collision_is_reported_as_await_ack_then_published_after_the_ack() {
    let broker = client_test_broker();
    for v5 in [false, true] {
        let proxy = MqttProxy::start(broker.addr()).expect("proxy");
        proxy.hold_pubacks(1);
        let mut seen_all = Vec::new();
        let step = |seen: &mut Vec<Seen>, next: &mut dyn FnMut() -> Option<Seen>, want_await: bool| {
            let got = collect(&mut *next, |s| {
                if want_await {
                    s.contains(&Seen::AwaitAck(1))
                } else {
                    // The request sent with id 1 again, once the held PUBACK of id 1 freed it, and
                    // its own PUBACK. (Others, such as id 3's, may come before or after.)
                    s.iter()
                        .position(|x| *x == Seen::Publish(1))
                        .is_some_and(|at| s[at..].iter().any(|x| matches!(x, Seen::PubAck { pkid: 1, .. })))
                }
            });
            seen.extend(got);
        };
        if v5 {
            let (client, mut conn) = v5_client(proxy.addr(), "collide-v5", 3);
            for i in 0..4u8 {
                client
                    .publish(
                        "pin/collide",
                        rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                        false,
                        vec![i],
                    )
                    .expect("publish");
            }
            let mut next = || conn.recv().ok().and_then(seen_v5);
            step(&mut seen_all, &mut next, true);
            proxy.release_held();
            step(&mut seen_all, &mut next, false);
        } else {
            let (client, mut conn) = v4_client(proxy.addr(), "collide-v4", 3);
            for i in 0..4u8 {
                client
                    .publish("pin/collide", rumqttc::QoS::AtLeastOnce, false, vec![i])
                    .expect("publish");
            }
            let mut next = || conn.recv().ok().and_then(seen_v4);
            step(&mut seen_all, &mut next, true);
            proxy.release_held();
            step(&mut seen_all, &mut next, false);
        }
        let events: Vec<&Seen> = seen_all
            .iter()
            .filter(|s| matches!(s, Seen::Publish(_) | Seen::AwaitAck(_)))
            .collect();
        assert_eq!(
            events,
            [
                &Seen::Publish(1),
                &Seen::Publish(2),
                &Seen::Publish(3),
                &Seen::AwaitAck(1),
                &Seen::Publish(1)
            ],
            "v5={v5}: {seen_all:?}"
        );
        let await_at = seen_all
            .iter()
            .position(|s| *s == Seen::AwaitAck(1))
            .expect("await");
        let ack1 = seen_all
            .iter()
            .position(|s| matches!(s, Seen::PubAck { pkid: 1, .. }))
            .expect("ack 1");
        let republish = seen_all
            .iter()
            .rposition(|s| *s == Seen::Publish(1))
            .expect("publish 1");
        assert!(await_at < ack1 && ack1 < republish, "v5={v5}: {seen_all:?}");
    }
}

/// MQTT 5: a PUBACK with a refusal code is an event carrying the code, not an error; the
/// connection stays up and later publishes are acknowledged.
#[test]
fn mqtt5_a_refusing_puback_is_an_event_with_its_reason_and_the_connection_stays() {
    let broker = client_test_broker();
    let proxy = MqttProxy::start(broker.addr()).expect("proxy");
    proxy.answer_pubacks_with(1, 0x87);
    let (client, mut conn) = v5_client(proxy.addr(), "refused-v5", 10);
    for i in 0..3u8 {
        client
            .publish(
                "pin/refused",
                rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                false,
                vec![i],
            )
            .expect("publish");
    }
    let seen = collect(
        || conn.recv().ok().and_then(seen_v5),
        |s| count(s, |x| matches!(x, Seen::PubAck { .. })) >= 3,
    );
    let acks: Vec<(u16, u8)> = seen
        .iter()
        .filter_map(|s| match s {
            Seen::PubAck { pkid, reason } => Some((*pkid, *reason)),
            _ => None,
        })
        .collect();
    assert_eq!(acks[0], (1, 0x87), "{acks:?}");
    // The broker's own answers: success, or "no matching subscribers" (nobody subscribes here).
    assert!(
        acks[1..] == [(2, 0x10), (3, 0x10)] || acks[1..] == [(2, 0), (3, 0)],
        "{acks:?}"
    );
    assert_eq!(count(&seen, |s| matches!(s, Seen::Error(_))), 0, "{seen:?}");
}

/// MQTT 5: a reason code a PUBACK may not carry (mosquitto sends 0x95 for a publish above
/// `message_size_limit`) fails the connection with `InvalidConnectReturnCode(code)`, which the
/// relay reads as "the broker refused the oldest message in flight".
#[test]
fn mqtt5_a_puback_code_rumqttc_cannot_parse_fails_the_connection_with_the_code() {
    let broker = client_test_broker();
    let proxy = MqttProxy::start(broker.addr()).expect("proxy");
    proxy.answer_pubacks_with(1, 0x95);
    let (client, mut conn) = v5_client(proxy.addr(), "unparsable-v5", 10);
    client
        .publish(
            "pin/too-large",
            rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
            false,
            vec![1],
        )
        .expect("publish");
    let seen = collect(|| conn.recv().ok().and_then(seen_v5), |_| false);
    match seen.last() {
        Some(Seen::Error(e)) => assert!(e.contains("InvalidConnectReturnCode(149)"), "{e}"),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// MQTT 5: CONNACK's maximum packet size and receive maximum reach the application in the
/// ConnAck event (the relay sizes its window and its packet limit from them).
#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn mqtt5_connack_limits_reach_the_application() {
    let broker = Broker::builder()
        .kind(BrokerKind::Mosquitto)
        .max_packet_size(3000)
        .mosquitto_option("max_inflight_messages 7")
        .start()
        .expect("mosquitto");
    let (_client, mut conn) = v5_client(broker.addr(), "connack-v5", 10);
    let seen = collect(
        || conn.recv().ok().and_then(seen_v5),
        |s| s.iter().any(|x| matches!(x, Seen::ConnAck { .. })),
    );
    assert_eq!(
        seen.last(),
        Some(&Seen::ConnAck {
            max_packet: Some(3000),
            receive_max: Some(7)
        })
    );
}

/// The driver waits with `recv_timeout` once connected (to act on a reconnect request): a
/// timeout must lose nothing. 500 publishes polled with a 1 ms timeout: every publish and every
/// PUBACK is seen, and no error.
#[test]
fn recv_timeout_on_a_connected_session_loses_no_event() {
    let broker = client_test_broker();
    for v5 in [false, true] {
        let n = 500;
        let seen = if v5 {
            let (client, mut conn) = v5_client(broker.addr(), "timeout-v5", 20);
            let mut sent = 0;
            collect(
                || {
                    if sent < n
                        && client
                            .try_publish(
                                "pin/timeout",
                                rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                                false,
                                vec![1],
                            )
                            .is_ok()
                    {
                        sent += 1;
                    }
                    conn.recv_timeout(Duration::from_millis(1)).ok().and_then(seen_v5)
                },
                |s| count(s, |x| matches!(x, Seen::PubAck { .. })) >= n,
            )
        } else {
            let (client, mut conn) = v4_client(broker.addr(), "timeout-v4", 20);
            let mut sent = 0;
            collect(
                || {
                    if sent < n
                        && client
                            .try_publish("pin/timeout", rumqttc::QoS::AtLeastOnce, false, vec![1])
                            .is_ok()
                    {
                        sent += 1;
                    }
                    conn.recv_timeout(Duration::from_millis(1)).ok().and_then(seen_v4)
                },
                |s| count(s, |x| matches!(x, Seen::PubAck { .. })) >= n,
            )
        };
        let errors: Vec<&Seen> = seen.iter().filter(|s| matches!(s, Seen::Error(_))).collect();
        assert!(errors.is_empty(), "v5={v5}: {errors:?}");
        assert_eq!(count(&seen, |s| matches!(s, Seen::Publish(_))), n, "v5={v5}");
    }
}

/// A requested DISCONNECT is reported as `Outgoing::Disconnect` (the driver ends a session on it).
#[test]
fn a_disconnect_request_is_reported_as_outgoing_disconnect() {
    let broker = client_test_broker();
    let (client, mut conn) = v5_client(broker.addr(), "bye-v5", 10);
    let _ = collect(
        || conn.recv().ok().and_then(seen_v5),
        |s| s.iter().any(|x| matches!(x, Seen::ConnAck { .. })),
    );
    client.try_disconnect().expect("disconnect");
    let seen = collect(
        || conn.recv().ok().and_then(seen_v5),
        |s| s.contains(&Seen::Disconnect),
    );
    assert_eq!(seen.last(), Some(&Seen::Disconnect));
    let (client, mut conn) = v4_client(broker.addr(), "bye-v4", 10);
    let _ = collect(
        || conn.recv().ok().and_then(seen_v4),
        |s| s.iter().any(|x| matches!(x, Seen::ConnAck { .. })),
    );
    client.try_disconnect().expect("disconnect");
    let seen = collect(
        || conn.recv().ok().and_then(seen_v4),
        |s| s.contains(&Seen::Disconnect),
    );
    assert_eq!(seen.last(), Some(&Seen::Disconnect));
}
