//! Signed commands (feature `signed-commands`): a device that trusts some keys applies a command
//! only if one of them signed it, for the topic it arrived on, within its validity window.
//! Tampered, wrong-key, unsigned, expired, too-old and replayed commands are refused; refusals
//! are dead-lettered with the reason, before anything is stored as applicable. The keys live in
//! the file and change only through `Outbox::require_signed_commands`.
#![cfg(feature = "signed-commands")]

mod common;
mod support;

use std::time::Duration;

use common::{TestResult, temp_db};
use edge_outbox::{
    CommandSigner, Envelope, Error, MessageId, Options, Outbox, Received, Relay, TrustedKeys, Tx,
};
use rumqttc::QoS;
use support::device::relay_config;
use support::{Broker, WAIT, publish_raw_many};

const TOPIC: &str = "devices/pump-17/commands/rate";

fn cloud() -> CommandSigner {
    CommandSigner::from_secret_key("cloud-2026", [11u8; 32])
}

fn next_key() -> CommandSigner {
    CommandSigner::from_secret_key("cloud-2027", [12u8; 32])
}

fn options(keys: TrustedKeys) -> Options {
    Options::new().trusted_command_keys(keys)
}

fn trusting(signers: &[&CommandSigner]) -> TrustedKeys {
    signers
        .iter()
        .fold(TrustedKeys::new(), |keys, s| keys.key(s.key_id(), s.public_key()))
}

fn command(credits: i64) -> TestResult<Envelope<'static>> {
    Ok(Envelope::command(MessageId::new_v7(), "pump-17", &credits)?)
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn refused(received: Received) -> String {
    match received {
        Received::DeadLettered { reason, .. } => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_valid_signed_command_is_stored_and_a_replay_is_a_duplicate() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open_with(&path, options(trusting(&[&cloud()])))?;
    let env = command(5)?;
    let signed = cloud().sign(TOPIC, &env, Duration::from_secs(600))?;
    assert_eq!(outbox.receive(TOPIC, &signed)?, Received::Stored(env.id));
    // The same signed bytes again, as an attacker who recorded them would send: a duplicate.
    assert_eq!(outbox.receive(TOPIC, &signed)?, Received::Duplicate(env.id));
    let mut applied = Vec::new();
    while let edge_outbox::ApplyOutcome::Applied { id, .. } = outbox.apply_next(|_tx, cmd| {
        assert_eq!(cmd.payload_as::<i64>()?, 5);
        Ok::<_, Error>(())
    })? {
        applied.push(id);
    }
    assert_eq!(applied, vec![env.id]);
    Ok(())
}

#[test]
fn tampered_wrong_key_unsigned_and_misdirected_commands_are_refused() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open_with(&path, options(trusting(&[&cloud()])))?;
    let env = command(5)?;

    let mut tampered = cloud().sign(TOPIC, &env, Duration::from_secs(600))?;
    // The envelope is inside as it was encoded; its last byte is the payload, the amount 5.
    let inner = env.encode();
    let at = tampered
        .windows(inner.len())
        .position(|w| w == inner.as_slice())
        .ok_or("the envelope inside the COSE_Sign1")?;
    tampered[at + inner.len() - 1] = 0x06;
    assert!(refused(outbox.receive(TOPIC, &tampered)?).contains("does not verify"));

    let impostor = CommandSigner::from_secret_key("cloud-2026", [99u8; 32]);
    let reason = refused(outbox.receive(TOPIC, &impostor.sign(TOPIC, &env, Duration::from_secs(600))?)?);
    assert!(
        reason.contains("does not verify with key \"cloud-2026\""),
        "{reason}"
    );

    let stranger = CommandSigner::from_secret_key("someone", [98u8; 32]);
    let reason = refused(outbox.receive(TOPIC, &stranger.sign(TOPIC, &env, Duration::from_secs(600))?)?);
    assert!(
        reason.contains("key id \"someone\" is not a trusted key"),
        "{reason}"
    );

    let reason = refused(outbox.receive(TOPIC, &env.encode())?);
    assert!(reason.contains("not signed"), "{reason}");

    // Signed for another device's topic, replayed on this one.
    let other = cloud().sign("devices/pump-18/commands/rate", &env, Duration::from_secs(600))?;
    let reason = refused(outbox.receive(TOPIC, &other)?);
    assert!(reason.contains("signed for another topic"), "{reason}");

    let reason = refused(outbox.receive(TOPIC, b"\xd2\x84garbage")?);
    assert!(reason.contains("not a COSE_Sign1"), "{reason}");

    assert_eq!(
        outbox.stats()?.inbox_unapplied,
        0,
        "nothing refused was stored as applicable"
    );
    let dead = outbox.dead_letters(10)?;
    assert_eq!(dead.len(), 6);
    assert!(dead.iter().all(|d| d.payload.is_some()), "the raw bytes are kept");
    Ok(())
}

#[test]
fn expired_too_old_and_future_commands_are_refused() -> TestResult {
    let (_dir, path) = temp_db()?;
    let keys = trusting(&[&cloud()])
        .max_age(Duration::from_secs(3600))
        .clock_skew(Duration::from_secs(60));
    let outbox = Outbox::open_with(&path, options(keys))?;
    let env = command(1)?;
    let t = now();

    let reason = refused(outbox.receive(TOPIC, &cloud().sign_at(TOPIC, &env, t - 600, t - 1)?)?);
    assert!(reason.contains("expired"), "{reason}");
    // A recorded command replayed after the inbox could have forgotten its id: its expiry was
    // generous, the device's maximum age is not.
    let reason = refused(outbox.receive(TOPIC, &cloud().sign_at(TOPIC, &env, t - 7200, t + 86_400)?)?);
    assert!(reason.contains("older than the maximum age"), "{reason}");
    let reason = refused(outbox.receive(TOPIC, &cloud().sign_at(TOPIC, &env, t + 600, t + 1200)?)?);
    assert!(reason.contains("ahead of this device's clock"), "{reason}");
    // Within the skew is fine.
    assert_eq!(
        outbox.receive(TOPIC, &cloud().sign_at(TOPIC, &env, t + 30, t + 600)?)?,
        Received::Stored(env.id)
    );
    Ok(())
}

#[test]
fn keys_rotate_by_trusting_the_new_one_beside_the_old_then_dropping_the_old() -> TestResult {
    let (_dir, path) = temp_db()?;
    let (old, new) = (cloud(), next_key());
    let during = Outbox::open_with(&path, options(trusting(&[&old, &new])))?;
    for signer in [&old, &new] {
        let env = command(1)?;
        assert_eq!(
            during.receive(TOPIC, &signer.sign(TOPIC, &env, Duration::from_secs(600))?)?,
            Received::Stored(env.id)
        );
    }
    // The file keeps the keys it trusts: new options alone do not change them.
    match Outbox::open_with(&path, options(trusting(&[&new]))) {
        Err(Error::InvalidConfig(why)) => assert!(why.contains("require_signed_commands"), "{why}"),
        other => panic!("options with other keys were accepted: {other:?}"),
    }
    // Dropping the old key is an explicit operation, and logged.
    during.require_signed_commands(trusting(&[&new]))?;
    drop(during);
    let after = Outbox::open_with(&path, options(trusting(&[&new])))?;
    let changes: i64 = after.with_connection(|c| {
        c.query_row("SELECT count(*) FROM edge_outbox_command_policy_log", [], |r| {
            r.get(0)
        })
    })?;
    assert_eq!(changes, 2, "required at the first open, then the old key dropped");
    let env = command(1)?;
    let reason = refused(after.receive(TOPIC, &old.sign(TOPIC, &env, Duration::from_secs(600))?)?);
    assert!(reason.contains("\"cloud-2026\" is not a trusted key"), "{reason}");
    Ok(())
}

#[test]
fn unsafe_configurations_are_refused_at_open() -> TestResult {
    let (_dir, path) = temp_db()?;
    let bad = [
        Options::new().trusted_command_keys(TrustedKeys::new()),
        // A maximum age past the retention would let a replay arrive after its id was pruned.
        options(trusting(&[&cloud()]).max_age(Duration::from_secs(8 * 24 * 3600))),
        options(trusting(&[&cloud()])).inbox_retention(Duration::from_secs(1800)),
    ];
    for options in bad {
        match Outbox::open_with(&path, options) {
            Err(Error::InvalidConfig(why)) => eprintln!("refused: {why}"),
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }
    // About half of all 32-byte strings are not a point on the curve: one of these is refused.
    let refused = (2u8..40).any(|b| {
        let keys = TrustedKeys::new().key("k", [b; 32]);
        matches!(Outbox::open_with(&path, options(keys)),
            Err(Error::InvalidConfig(why)) if why.contains("not an Ed25519 public key"))
    });
    assert!(refused, "no malformed public key was refused");
    Ok(())
}

#[test]
fn through_the_relay_only_the_authentic_command_is_applied() -> TestResult {
    let broker = Broker::start()?;
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open_with(&path, options(trusting(&[&cloud()])))?;
    outbox.with_connection(|c| c.execute_batch("CREATE TABLE credits (amount INTEGER)"))?;
    let relay = Relay::start_with_handler(
        &outbox,
        relay_config(broker.addr(), "signed-device").commands("devices/pump-17/commands/#"),
        |tx: &mut Tx<'_>, cmd: &edge_outbox::Command| {
            tx.execute("INSERT INTO credits VALUES (?1)", [cmd.payload_as::<i64>()?])?;
            Ok::<_, Error>(())
        },
    )?;
    let deadline = std::time::Instant::now() + WAIT;
    while !relay.status()?.commands_connected {
        assert!(
            std::time::Instant::now() < deadline,
            "command session never subscribed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let genuine = cloud().sign(TOPIC, &command(40)?, Duration::from_secs(600))?;
    let forged = CommandSigner::from_secret_key("cloud-2026", [1u8; 32]).sign(
        TOPIC,
        &command(1_000_000)?,
        Duration::from_secs(600),
    )?;
    let unsigned = command(1_000_000)?.encode();
    publish_raw_many(
        broker.addr(),
        &[
            (TOPIC, &forged),
            (TOPIC, &unsigned),
            (TOPIC, &genuine),
            (TOPIC, &genuine),
        ],
        QoS::AtLeastOnce,
    )?;
    while relay.status()?.commands_duplicate < 1 || relay.status()?.commands_applied < 1 {
        assert!(std::time::Instant::now() < deadline, "{:?}", relay.status()?);
        std::thread::sleep(Duration::from_millis(5));
    }
    let total: i64 =
        outbox.with_connection(|c| c.query_row("SELECT sum(amount) FROM credits", [], |r| r.get(0)))?;
    assert_eq!(total, 40);
    assert_eq!(relay.status()?.commands_malformed, 2);
    relay.shutdown()?;
    Ok(())
}
