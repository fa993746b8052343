//! Deliberately broken builds, to prove the tests catch what they claim to (feature `mutants`;
//! never in production). `EDGE_OUTBOX_MUTANT=<name>` switches one on; each breaks one guarantee.
//! With each of [`MUTANTS`], `cargo test --all-features --test crash` must fail (its own last
//! scenario runs the harness against each and fails if one survives); each of
//! [`SCENARIO_MUTANTS`] is caught by the test file it names, which runs itself against it; each
//! of [`MODEL_MUTANTS`] by the publishing core's model. See docs/reliability.md and
//! docs/model.md.
//!
//! Without the feature, [`active`] is a constant `false` and every mutant compiles away.

/// Every mutant name.
pub const MUTANTS: &[&str] = &[
    // Rows are marked when handed to the MQTT client, not on their PUBACK.
    "mark-before-puback",
    // After a reconnect, publishing resumes after the last row sent, not at the oldest
    // unacknowledged one.
    "skip-resume",
    // A command is acknowledged to the broker before its inbox row commits.
    "ack-before-commit",
    // The apply step ignores the `applied_at IS NULL` guard.
    "double-apply",
    // Rows of a key are published out of commit order.
    "reorder",
    // Coalescing rows are published without being claimed, so a newer value replaces one that is
    // on the wire (it is delivered and announced coalesced).
    "skip-claim",
];

/// Mutants of guarantees the crash harness's scenarios do not exercise (who may command a device,
/// how a claim is released, expiry behind a pace, salvage, the consumer's bounds, restored
/// files), each caught by its own scenario test instead: (name, the test file that runs itself
/// with the mutant on and fails unless its scenario fails on its own verdict). They are not in
/// [`MUTANTS`]: the crash harness is not expected to catch them.
pub const SCENARIO_MUTANTS: &[(&str, &str)] = &[
    // A rejection's reply is published in a transaction of its own, ahead of the rejection's
    // guarded record: an attempt recovered meanwhile still answers, and one rejection gets two
    // replies.
    ("rejection-reply-apart", "tests/command_rejection.rs"),
    // A rejected command is copied into the dead letters as well: the alert on dead letters
    // fires for every command the cloud sends wrong.
    ("rejection-dead-lettered", "tests/command_rejection.rs"),
    // `edge-outbox relay` pings the service manager's watchdog whatever its publishing thread
    // does: a wedged relay is never restarted.
    ("watchdog-ignores-heartbeat", "tests/systemd_notify.rs"),
    // `edge-outbox relay` on SIGHUP restarts its threads with the settings it started with, not
    // the re-read file's: a rotated password or certificate never takes effect.
    ("reload-keeps-running-config", "tests/config_reload.rs"),
    // The TLS handshake offers no ALPN protocol, whatever `TlsConfig::alpn` asked for: AWS IoT
    // Core on port 443 refuses every connection.
    ("alpn-dropped", "tests/cloud_alpn.rs"),
    // The sessions connect to the broker directly, ignoring `MqttConfig::http_proxy`: a device on
    // a network that lets nothing out but through the proxy never connects.
    ("proxy-ignored", "tests/http_proxy.rs"),
    // A SAS key's first token is used for every connection and never renewed: Azure IoT Hub
    // closes the connection when it expires and refuses every one after it.
    ("sas-not-renewed", "tests/cloud_azure_sas.rs"),
    // Certificate, key, CA and password files are read once, when the settings are made: a
    // rotated credential is never used until a restart.
    ("credential-files-read-once", "tests/credentials_rotate.rs"),
    // The shared session of single-session mode starts clean: the broker forgets its
    // subscription between connections, and a command sent while the device is offline is lost.
    ("single-session-clean", "tests/single_session.rs"),
    // The relay publishes rows whose topic breaks its cloud profile's rules (written by a process
    // without `Limits::cloud`): the cloud drops the connection over each, and the rest wait.
    ("cloud-rules-unchecked", "tests/cloud_profiles.rs"),
    // Azure IoT Hub's property bag is written without URL-encoding: a key holding `&`, `=` or
    // `/` ends its pair (or adds a topic level), and the hub routes on the wrong values.
    ("property-bag-unencoded", "tests/routing_fields.rs"),
    // The JSON envelope carries a payload JSON has no form for by changing it (a byte string as
    // hex text, NaN as null) instead of setting it aside: the cloud gets other data than written.
    ("json-lossy-payload", "tests/json_envelope.rs"),
    // A latest-values commit that fails (the file busy) drops the values it held instead of
    // keeping them for the next interval: a reading is lost although the file was only busy.
    ("latest-dropped-on-failure", "tests/latest_values.rs"),
    // The command intake commits each delivery on its own instead of a burst at a time: a
    // broker's queue after an outage costs a commit and a sync per command.
    ("command-commit-each", "tests/command_bursts.rs"),
    // A retried outgoing dead letter goes back in lane 0, with no lifetime, not evictable.
    ("retry-loses-settings", "tests/outbox_dead_letter_retry.rs"),
    // Receiving verifies with the handle's own keys only, not the file's: a keyless handle (the
    // CLI's retry) stores unsigned commands.
    ("handle-keys-only", "tests/signed_any_handle.rs"),
    // A claim whose record step failed (the database locked past the busy timeout) is left set:
    // its key is blocked until the attempt timeout.
    ("strand-claim", "tests/busy_claim_released.rs"),
    // With retained commands kept, a live delivery (retain flag cleared by the broker) is stored
    // as not retained: its id is pruned, and the broker's resend at the next subscription is
    // applied again.
    ("live-not-retained", "tests/retained_live_applied_once.rs"),
    // Refused deliveries are kept without bound: a flood of junk fills the disk.
    ("unbounded-refusals", "tests/refusal_flood.rs"),
    // Pruning forgets command ids after the pruning handle's own retention, not at least the
    // file's replay window: a handle with a shorter one reopens the window for replays.
    ("own-retention", "tests/signed_replay_window_prune.rs"),
    // The connection thread holds the reports of publishes written until the broker sends
    // something, with no bound: a publish the broker never answers is never known to be on the
    // wire, so its ack timeout never starts, and the relay waits on it for good.
    ("reports-wait-for-news", "tests/poison_isolation.rs"),
    // A publish packed and held back by the pace goes out without its expiry checked again.
    ("skip-expiry-held-back", "tests/expiry_held_back.rs"),
    // Salvage records a lost range in one gap row, ignored when a gap row has its first number.
    ("salvage-gap-ignored", "tests/salvage_gap_collision.rs"),
    // A salvage's unrecoverable range covers numbers kept as acknowledged in `outbox_sent`.
    ("salvage-covers-sent", "tests/salvage_sent_numbers.rs"),
    // A salvage that renumbers the pending messages (the epochs unreadable) copies the gap rows
    // with their old numbers, which then name renumbered messages.
    (
        "salvage-renumbered-gaps-kept",
        "tests/salvage_unreadable_epochs.rs",
    ),
    // Salvage creates a virtual table again through its module, which the CLI's SQLite lacks
    // (FTS5, R*Tree): the application's full-text index is lost.
    (
        "salvage-virtual-table-recreated",
        "tests/salvage_virtual_tables.rs",
    ),
    // The consumer takes a number at or below its horizon (a gap given up on past `max_gaps`) as
    // seen, and ignores a notice there.
    ("consumer-forgotten-seen", "tests/consumer_bounds.rs"),
    // A durable consumer saves nothing: after a restart it counts each source again from the
    // first number it sees, missing what was lost while it was down, and takes a message whose
    // effect committed for a new one.
    ("consumer-state-unsaved", "tests/consumer_restart.rs"),
    // After a change to the WAL file, the relay rechecks every few milliseconds for the whole
    // second: a change that never shows as a commit costs an idle relay hundreds of wake-ups.
    ("recheck-flat", "tests/idle_wakeups.rs"),
    // After a change to the WAL file, the relay rechecks for one second only: a foreign commit
    // whose sync stalls longer waits for the poll interval.
    ("recheck-no-tail", "tests/slow_sync_found.rs"),
    // A CONNACK's Receive Maximum of 0, which MQTT 5 forbids, is taken as it stands: rumqttc
    // writes nothing on that connection, and the relay stalls looking connected.
    ("receive-max-zero-taken", "tests/broker_refusals.rs"),
    // Any accepted PUBACK ends a quota pause's error and resets its backoff, also one for a
    // message written before the refusal: a broker that stays over quota is retried at the
    // shortest wait whenever more than one message is in flight.
    ("quota-cleared-by-earlier", "tests/broker_refusals.rs"),
    // A suspected message is published again as soon as a connection is up: a broker that
    // ends every connection soon after accepting it (a cluster moving its queues) gets the
    // innocent message that happened to be on the wire isolated as poison.
    ("suspect-written-at-once", "tests/poison_isolation.rs"),
    // Rows keep going out one at a time after the poison row the cut's drops were over was
    // isolated: a window of rows is then published at a window of one.
    ("probe-kept-after-isolation", "tests/batching.rs"),
    // A durable consumer keeps the verdicts of a transaction that rolled back: the message whose
    // effect failed is a duplicate when it comes again, and its effect never happens.
    ("consumer-kept-after-rollback", "tests/consumer_restart.rs"),
    // Opening a store skips the check of its counter against what was published from its path,
    // so a backup restored in place keeps its epoch.
    ("skip-published-check", "tests/epochs_restored_in_place.rs"),
    // Eviction at a storage limit and the store's expiry remove rows the relay has claimed.
    ("remove-claimed", "tests/claimed_rows_kept.rs"),
    // The lanes are served lowest first: an alarm waits behind the telemetry backlog.
    ("lanes-lowest-first", "tests/priority.rs"),
    // The pace is ignored: a backlog goes out at the link's full rate.
    ("pace-ignored", "tests/pacing.rs"),
    // The relay takes no commit by another connection as news (as a check of the outbox's
    // numbers that reads the wrong table would): an idle relay never publishes a row another
    // process writes.
    ("foreign-rows-unseen", "tests/relay_end_to_end.rs"),
    // `Tx::publish` and `Tx::send` skip the payload schema: an invalid event commits with its
    // business change.
    ("schema-unchecked-at-write", "tests/payload_schemas.rs"),
    // The relay publishes a row another writer committed without checking it against its schema:
    // an invalid event reaches the cloud.
    ("schema-unchecked-at-relay", "tests/payload_schemas.rs"),
    // The consumer counts no schema violation: a device that does not check (an older build, a
    // foreign writer without a relay that checks) sends invalid events unnoticed.
    ("consumer-schema-unchecked", "tests/payload_schemas.rs"),
    // A running relay keeps the schemas it started with: every message of a version registered
    // since is dead-lettered as unregistered.
    ("schemas-read-once", "tests/payload_schemas.rs"),
];

/// Mutants of the publishing core that its model (`src/publish/core/model`, run by
/// `cargo test --lib publish::core::model`) must catch: with each, a random sequence or one of
/// its regression sequences fails, and `the_model_catches_every_model_mutant` checks that it
/// does.
pub const MODEL_MUTANTS: &[&str] = &[
    "mark-before-puback",
    "skip-resume",
    "reorder",
    "skip-claim",
    "skip-expiry-held-back",
    "remove-claimed",
    // A gap row naming a number on the wire (a row purged, evicted or expired while it was being
    // published) is announced at once: the cloud gets the message and a notice that it was
    // removed.
    "announce-unsettled",
    // Rows read ahead (or held back by the pace) are published although a notice read since says
    // they were removed.
    "publish-removed",
    // A batch's PUBACK marks its first row only: the others are published again and again.
    "batch-first-only",
    // The pace's deadline is named as the next wake-up during an outage, a quota pause or a stop,
    // when nothing can follow it: once it has passed, the publisher wakes at once, again and again.
    "stale-pace-deadline",
    // Probing (one row at a time after a connection ended with a window on the wire) ends at the
    // first answer on the next connection: the window reopens before the cut's rows were each on
    // the wire alone.
    "probe-ends-at-any-answer",
    // While probing, the highest lane is always served first: with alarms written steadily the
    // cut's rows of lane 0 wait behind them, and the window stays at one.
    "probe-served-by-priority",
    // While probing, the cut's rows always go first: an alarm waits behind every one of them
    // (with batches on the wire at the cut, minutes).
    "probe-without-turns",
    // Any PUBACK read after a message was written counts as the broker passing it over: a broker
    // that answers an older message and then nothing more (out of disk) gets the newer one
    // struck at each ack timeout, and dead-lettered.
    "answered-at-any-ack",
    // Whether a later message was answered is judged by write times: rows handed over in one
    // burst can read the same clock, so a message the broker passes over among them is never
    // struck, and it is published again at every ack timeout for ever.
    "answered-by-write-time",
    // A publish with a lifetime is queued behind the broker's receive maximum like any other:
    // it waits in rumqttc's queue, where no expiry check sees it, and is written after its
    // expiry.
    "queue-expiring",
];

/// The scenarios that can see mutant `name`, when only some can (a filter on scenario names);
/// `None`: all of them run.
pub fn scenarios_for(name: &str) -> Option<&'static str> {
    match name {
        "skip-claim" => Some("lanes"),
        _ => None,
    }
}

/// Whether the mutant `name` is switched on.
#[cfg(feature = "mutants")]
pub fn active(name: &str) -> bool {
    use std::sync::OnceLock;
    static ACTIVE: OnceLock<Option<String>> = OnceLock::new();
    ACTIVE
        .get_or_init(|| std::env::var("EDGE_OUTBOX_MUTANT").ok().filter(|m| !m.is_empty()))
        .as_deref()
        == Some(name)
}

/// Without the `mutants` feature nothing is broken.
#[cfg(not(feature = "mutants"))]
#[inline(always)]
pub const fn active(_name: &str) -> bool {
    false
}
