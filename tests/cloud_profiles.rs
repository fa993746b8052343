//! Cloud profiles: a cloud's documented limits refused where events are written, naming the
//! limit, and checked again by the relay for rows written without them; the CLI's `--profile`
//! against local stand-ins that enforce each cloud's rules:
//!
//! - AWS IoT Core: a TLS front that refuses a handshake without ALPN `x-amzn-mqtt-ca`
//!   (tests/support/alpn_front.rs), before an MQTT front that drops the connection over a
//!   publish AWS refuses (`$aws/` reserved, more than 7 slashes, a topic above 256 bytes, a
//!   message above 128 KiB);
//! - Azure IoT Hub: the SAS front of tests/cloud_azure_sas.rs, which also drops the connection
//!   over a publish outside `devices/{id}/messages/events/` or a retained one, and refuses any
//!   client id but the device's.
//!
//! A relay that published what its profile's rules refuse (mutant `cloud-rules-unchecked`) is
//! caught: the stand-in drops its connection.

mod support;

use std::time::Duration;

use edge_outbox::{CloudProfile, Error, Limits, MqttConfig, Options, Outbox, RelayConfig};
use support::alpn_front::AlpnFront;
use support::azure_sas::Hub;
use support::credits::command;
use support::device::{commit_orders, open_device};
use support::mqtt_proxy::Publish;
use support::{Broker, BrokerKind, ChildGuard, MqttProxy, Pki, Subscriber, WAIT, check, wait_until};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

const DEVICE: &str = "pump-17";
const AWS_ALPN: &str = "x-amzn-mqtt-ca";
const HUB: &str = "stand-in-hub.azure-devices.net";
const EVENTS: &str = "devices/pump-17/messages/events/";
const AWS_CLI: &str = "the_cli_relay_with_the_aws_profile_delivers_and_sets_aside_what_aws_refuses";

/// What AWS IoT Core refuses of a publish (its documented limits).
fn aws_refuses(p: &Publish) -> bool {
    p.topic.starts_with("$aws/")
        || p.topic.len() > 256
        || p.topic.matches('/').count() > 7
        || p.payload.len() > 128 * 1024
}

/// What Azure IoT Hub refuses of a device's publish.
fn hub_refuses(p: &Publish) -> bool {
    p.retain || !p.topic.starts_with(EVENTS)
}

fn relay_cli(db: &std::path::Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_edge-outbox"));
    cmd.args(["relay", "--client-id", DEVICE, "--db"])
        .arg(db)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    cmd
}

#[test]
fn aws_limits_are_refused_where_events_are_written_and_name_the_limit() -> TestResult {
    let dir = tempfile::tempdir()?;
    let limits = Limits::new().cloud(CloudProfile::AwsIotCore, DEVICE);
    let outbox = Outbox::open_with(
        dir.path().join("o.db"),
        Options::new().limits(limits.allow_dollar_topics(true)),
    )?;
    outbox.with_connection(|c| c.execute_batch("CREATE TABLE t (n INTEGER)"))?;
    let deep = "a/b/c/d/e/f/g/h/i";
    let long = format!("t/{}", "x".repeat(260));
    for (topic, payload, limit) in [
        (deep, 8, "7 slashes"),
        (long.as_str(), 8, "256 bytes"),
        ("$aws/rules/ingest/a/b/c/d/e/f/g/h/i", 8, "7 slashes"),
        // Above the cloud's 128 KiB less the envelope's room.
        ("pumps/17", 127 * 1024, "bytes"),
    ] {
        let refused = outbox
            .transaction(|tx| {
                tx.execute("INSERT INTO t VALUES (1)", [])?;
                tx.publish(topic, DEVICE, &"x".repeat(payload))?;
                Ok::<_, Error>(())
            })
            .expect_err(topic);
        assert!(refused.to_string().contains(limit), "{topic}: {refused}");
        if payload < 1000 {
            assert!(refused.to_string().contains("AWS IoT Core"), "{refused}");
        } else {
            assert!(matches!(refused, Error::PayloadTooLarge { .. }), "{refused}");
        }
    }
    // Nothing of the refused transactions was kept; messages within the limits go in: 7
    // slashes, a reserved topic the device may use (with allow_dollar_topics), Basic Ingest's
    // prefix not counted, and a payload above the default 64 KiB but within AWS's size.
    let rows: i64 = outbox.with_connection(|c| c.query_row("SELECT count(*) FROM t", [], |r| r.get(0)))?;
    assert_eq!((rows, outbox.stats()?.pending_messages), (0, 0));
    outbox.transaction(|tx| {
        tx.publish("a/b/c/d/e/f/g/h", DEVICE, &1)?;
        tx.publish("$aws/things/pump-17/shadow/update", DEVICE, &1)?;
        tx.publish("$aws/rules/ingest/a/b/c/d/e/f/g/h", DEVICE, &1)?;
        tx.publish("pumps/17", DEVICE, &"x".repeat(100 * 1024))
    })?;
    assert_eq!(outbox.stats()?.pending_messages, 4);
    Ok(())
}

#[test]
fn each_profile_sets_its_settings_and_refuses_what_breaks_its_rules() -> TestResult {
    let hub = MqttConfig::new(HUB, 8883).client_id(DEVICE);
    let config = RelayConfig::new(hub.clone())
        .cloud(CloudProfile::AzureIotHub)
        .commands("devices/pump-17/messages/devicebound/#");
    assert_eq!(config.mqtt().version(), edge_outbox::Protocol::V311);
    assert_eq!(config.mqtt().packet_limit(), 256 * 1024);
    assert!(config.is_single_session());
    config.check()?;
    let retained = RelayConfig::new(hub.clone().status_topic(format!("{EVENTS}status")))
        .cloud(CloudProfile::AzureIotHub)
        .check()
        .expect_err("a status topic on IoT Hub");
    assert!(retained.to_string().contains("retained"), "{retained}");
    let filter = RelayConfig::new(hub.clone())
        .cloud(CloudProfile::AzureIotHub)
        .commands("pumps/17/commands/#")
        .check()
        .expect_err("commands where IoT Hub sends none");
    assert!(filter.to_string().contains("devicebound"), "{filter}");

    // A setting made after the profile replaces its own.
    let aws = MqttConfig::new("abc-ats.iot.eu-west-1.amazonaws.com", 8883).client_id(DEVICE);
    let config = RelayConfig::new(aws.clone()).cloud(CloudProfile::AwsIotCore);
    assert_eq!(config.mqtt().version(), edge_outbox::Protocol::V5);
    // A window set before the profile is lowered to its cap; one set after is refused.
    RelayConfig::new(aws.clone())
        .max_in_flight(500)
        .cloud(CloudProfile::AwsIotCore)
        .check()?;
    let over = config.max_in_flight(500).check().expect_err("above AWS's cap");
    assert!(
        over.to_string().contains("AWS IoT Core") && over.to_string().contains("100"),
        "{over}"
    );
    let own = aws
        .cloud(CloudProfile::AwsIotCore)
        .protocol(edge_outbox::Protocol::V311);
    let config = RelayConfig::new(own).cloud(CloudProfile::AwsIotCore);
    assert_eq!(
        config.mqtt().version(),
        edge_outbox::Protocol::V311,
        "the override is kept"
    );

    // On port 443 AWS needs the ALPN protocol: the profile offers it, whether TLS is set
    // before or after it.
    let on_443 = MqttConfig::new("abc-ats.iot.eu-west-1.amazonaws.com", 443)
        .tls(edge_outbox::TlsConfig::system_roots())
        .cloud(CloudProfile::AwsIotCore);
    assert!(format!("{on_443:?}").contains(AWS_ALPN), "{on_443:?}");
    let tls_after = MqttConfig::new("abc-ats.iot.eu-west-1.amazonaws.com", 443)
        .cloud(CloudProfile::AwsIotCore)
        .tls(edge_outbox::TlsConfig::system_roots());
    assert!(format!("{tls_after:?}").contains(AWS_ALPN), "{tls_after:?}");
    let on_8883 = MqttConfig::new("abc-ats.iot.eu-west-1.amazonaws.com", 8883)
        .tls(edge_outbox::TlsConfig::system_roots())
        .cloud(CloudProfile::AwsIotCore);
    assert!(!format!("{on_8883:?}").contains(AWS_ALPN), "{on_8883:?}");

    let grid =
        RelayConfig::new(MqttConfig::new("ns.westeurope-1.ts.eventgrid.azure.net", 8883).client_id(DEVICE))
            .cloud(CloudProfile::AzureEventGrid);
    assert_eq!(
        (grid.mqtt().version(), grid.mqtt().packet_limit()),
        (edge_outbox::Protocol::V5, 512 * 1024)
    );
    grid.check()?;
    Ok(())
}

#[test]
fn the_cli_relay_with_the_aws_profile_delivers_and_sets_aside_what_aws_refuses() -> TestResult {
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"), "aws-stand-in")?;
    let broker = Broker::start()?;
    let rules = MqttProxy::start(broker.addr())?;
    rules.close_on_publish(aws_refuses);
    let front = AlpnFront::start(&pki, AWS_ALPN.as_bytes(), rules.addr())?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    // Another process wrote two rows without the profile's limits, among good ones.
    let mut committed = commit_orders(&outbox, &["a", "b"], 10, 0);
    let foreign = Outbox::open_with(
        outbox.path(),
        Options::new().limits(Limits::new().allow_dollar_topics(true)),
    )?;
    foreign.transaction(|tx| {
        tx.publish(&format!("orders/{}", "x".repeat(260)), "x", &1)?;
        tx.publish("orders/a/b/c/d/e/f/g/h", "x", &2)
    })?;
    committed.extend(commit_orders(&outbox, &["a", "b"], 10, 0));
    let mut relay = relay_cli(outbox.path());
    if broker.kind() == BrokerKind::Rumqttd {
        // rumqttd 0.20 cannot forward a publish with MQTT 5 properties to this test's 3.1.1
        // subscriber (tests/routing_fields.rs checks the fields themselves on both brokers).
        relay.args(["--routing-fields", "off"]);
    }
    let child = relay
        .args(["--profile", "aws-iot-core"])
        .args(["--broker", &format!("mqtts://127.0.0.1:{}", front.addr().port())])
        .args(["--alpn", AWS_ALPN, "--ca"])
        .arg(&pki.ca_cert)
        .arg("--cert")
        .arg(&pki.client_cert)
        .arg("--key")
        .arg(&pki.client_key)
        .spawn()?;
    let _relay = ChildGuard::new(child);
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    assert!(
        wait_until(|| outbox.dead_letters(10).is_ok_and(|d| d.len() == 2)),
        "both rows AWS refuses set aside"
    );
    assert_eq!(
        rules.closed_on_publish(),
        0,
        "the relay published nothing the stand-in for AWS drops the connection over"
    );
    for dead in outbox.dead_letters(10)? {
        assert!(
            dead.reason.contains("AWS IoT Core"),
            "{}: {}",
            dead.topic,
            dead.reason
        );
    }
    assert_eq!(front.refused(), 0, "the relay's TLS had the ALPN protocol");
    Ok(())
}

#[test]
fn a_relay_that_ignores_its_profiles_topic_rules_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "cloud-rules-unchecked",
        AWS_CLI,
        "the relay published nothing the stand-in for AWS drops the connection over",
    )
}

#[test]
fn the_cli_relay_with_the_azure_profile_renews_and_takes_commands_on_one_session() -> TestResult {
    let broker = Broker::start()?;
    // Without a hub name of its own, the CLI signs tokens for the broker's host.
    let hub = Hub::new("127.0.0.1", DEVICE);
    let front = MqttProxy::start(broker.addr())?;
    {
        let hub = hub.clone();
        front.authenticate(move |connect| hub.check(connect));
    }
    front.close_on_publish(hub_refuses);
    let sub = Subscriber::start(broker.addr(), "devices/pump-17/messages/events/#")?;
    let dir = tempfile::tempdir()?;
    let key_file = dir.path().join("sas-key");
    std::fs::write(&key_file, hub.key_base64())?;
    let outbox = Outbox::open_with(
        dir.path().join("device.db"),
        Options::new().limits(Limits::new().cloud(CloudProfile::AzureIotHub, DEVICE)),
    )?;
    let mut committed = Vec::new();
    let mut commit = |n: usize| -> edge_outbox::Result<()> {
        for i in 0..n {
            let key = ["a", "b"][i % 2];
            let id = outbox.transaction(|tx| tx.publish(EVENTS, key, &(i as u64)))?.ids[0];
            committed.push((id, key.to_owned()));
        }
        Ok(())
    };
    commit(20)?;
    // The lifetime's floor for the CLI (renewal must come after the connect timeout).
    let lifetime = 13;
    let child = relay_cli(outbox.path())
        .args(["--profile", "azure-iot-hub"])
        .args(["--broker", &format!("mqtt://127.0.0.1:{}", front.addr().port())])
        .arg("--sas-key-file")
        .arg(&key_file)
        .args(["--sas-lifetime", &lifetime.to_string()])
        .args(["--commands", "devices/pump-17/messages/devicebound/#"])
        .spawn()?;
    let _relay = ChildGuard::new(child);
    assert!(
        wait_until(|| front.auth_accepted() >= 1),
        "connected to the hub: {:?}",
        front.auth_refused()
    );
    // A cloud-to-device message, on the one session the device has.
    std::thread::sleep(Duration::from_millis(500));
    support::publish_raw(
        broker.addr(),
        "devices/pump-17/messages/devicebound/credit",
        &command(25),
        rumqttc::QoS::AtLeastOnce,
    )?;
    // Written until the relay has renewed its token once.
    let started = std::time::Instant::now();
    while front.auth_accepted() < 2 && started.elapsed() < WAIT {
        commit(4)?;
        std::thread::sleep(Duration::from_millis(250));
    }
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    assert!(
        wait_until(|| front.auth_accepted() >= 2),
        "the token was renewed within its lifetime: {} connections",
        front.auth_accepted()
    );
    assert_eq!(front.expired_closes(), 0, "no connection outlived its token");
    assert_eq!(
        front.auth_refused(),
        Vec::<String>::new(),
        "one client id, good tokens"
    );
    assert_eq!(
        front.closed_on_publish(),
        0,
        "nothing the hub refuses was published"
    );
    assert!(
        wait_until(|| outbox.stats().is_ok_and(|s| s.inbox_unapplied == 1)),
        "the command was stored: {:?}",
        outbox.stats()
    );
    // Acknowledged once stored: the renewal's new connection got no redelivery of it.
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["--json", "status", "--db"])
        .arg(outbox.path())
        .output()?;
    let shown: serde_json::Value = serde_json::from_slice(&status.stdout)?;
    assert_eq!(
        shown["relay"]["status"]["commands_duplicate"],
        serde_json::json!(0),
        "{shown}"
    );
    assert_eq!(
        shown["relay"]["status"]["commands_received"],
        serde_json::json!(1),
        "{shown}"
    );
    Ok(())
}

#[test]
fn the_cli_refuses_a_status_topic_with_the_azure_profile() -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = relay_cli(&dir.path().join("device.db"))
        .args([
            "--profile",
            "azure-iot-hub",
            "--broker",
            "mqtts://hub.azure-devices.net",
        ])
        .args(["--status-topic", "devices/pump-17/messages/events/status"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("retained"), "{stderr}");
    Ok(())
}
