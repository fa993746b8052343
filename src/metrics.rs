//! The store's and the relay's figures in the Prometheus text format (feature `metrics`), for
//! node_exporter's textfile collector or any scraper.
//!
//! [`encode`] takes what can be known from the database file alone ([`Stats`]) and, if a relay
//! reports on it, the relay's counters ([`RelayReport`]): `edge-outbox metrics` prints it, and a
//! relay configured with [`RelayConfig::metrics_file`](crate::RelayConfig::metrics_file) (or
//! `edge-outbox relay --metrics-file`) keeps a file of it up to date.
//!
//! ```
//! # let dir = tempfile::tempdir().expect("temp dir");
//! let outbox = edge_outbox::Outbox::open(dir.path().join("device.db"))?;
//! let text = edge_outbox::metrics::encode(&outbox.stats()?, None);
//! assert!(text.contains("edge_outbox_pending_messages 0"));
//! # Ok::<(), edge_outbox::Error>(())
//! ```
//!
//! Every metric is named `edge_outbox_*`. Counters count since the relay started (a restart
//! starts them again, as Prometheus expects of counters); the relay's metrics are absent when no
//! relay reports (`edge_outbox_relay_up` 0).

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};

use crate::report::RelayReport;
use crate::store::Stats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

/// Prometheus text for `stats` and, if a relay reports, its `relay` counters.
pub fn encode(stats: &Stats, relay: Option<&RelayReport>) -> String {
    let mut r = Registry::with_prefix("edge_outbox");
    gauge(
        &mut r,
        "pending_messages",
        "Messages committed and not yet acknowledged by the broker",
        stats.pending_messages,
    );
    gauge(
        &mut r,
        "pending_bytes",
        "Payload bytes of the pending messages",
        stats.pending_bytes,
    );
    let age: Gauge<f64, std::sync::atomic::AtomicU64> = Gauge::default();
    age.set(stats.oldest_pending_age.map_or(0.0, |a| a.as_secs_f64()));
    r.register_with_unit(
        "oldest_pending_age",
        "Age of the oldest pending message (0 when none): the alert to watch",
        Unit::Seconds,
        age,
    );
    counter(
        &mut r,
        "evicted",
        "Messages evicted unsent to make room, since the file was created",
        stats.evicted,
    );
    counter(
        &mut r,
        "evicted_bytes",
        "Payload bytes of the evicted messages",
        stats.evicted_bytes,
    );
    counter(
        &mut r,
        "coalesced",
        "Messages replaced unsent by a newer coalescing message of their topic and key",
        stats.coalesced,
    );
    gauge(
        &mut r,
        "dead_letters",
        "Dead letters waiting for an operator",
        stats.dead_letters,
    );
    gauge(
        &mut r,
        "refusals_kept",
        "Dead letters of deliveries refused before they were stored (bounded)",
        stats.refusals_kept,
    );
    counter(
        &mut r,
        "refusals_evicted",
        "Refused deliveries evicted from the dead letters to stay within their bounds",
        stats.refusals_evicted,
    );
    gauge(
        &mut r,
        "inbox_unapplied",
        "Commands received and not yet applied",
        stats.inbox_unapplied,
    );
    gauge(
        &mut r,
        "inbox_applied_kept",
        "Applied command ids kept to recognise redeliveries",
        stats.inbox_applied,
    );
    gauge(
        &mut r,
        "inbox_rejected_kept",
        "Commands their handler rejected, kept for the retention (not dead letters)",
        stats.inbox_rejected,
    );
    gauge(
        &mut r,
        "relay_up",
        "1 while a relay reports on this database",
        u64::from(relay.is_some()),
    );
    if let Some(rep) = relay {
        relay_metrics(&mut r, rep);
    }
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &r);
    out
}

fn relay_metrics(r: &mut Registry, rep: &RelayReport) {
    gauge(
        r,
        "relay_connected",
        "1 while the publishing session is connected",
        u64::from(rep.connected),
    );
    gauge(
        r,
        "relay_commands_connected",
        "1 while the command session is connected and subscribed",
        u64::from(rep.commands_connected),
    );
    gauge(
        r,
        "relay_in_flight",
        "Messages handed to the MQTT client and not yet acknowledged",
        rep.in_flight,
    );
    counter(
        r,
        "relay_published",
        "Outbox messages handed to the broker (resends included; gap notices apart)",
        rep.published,
    );
    counter(
        r,
        "relay_notices_published",
        "Gap notices handed to the broker",
        rep.notices_published,
    );
    counter(
        r,
        "relay_resent",
        "Messages handed over again after a reconnect: possible duplicates downstream",
        rep.resent,
    );
    counter(
        r,
        "relay_acknowledged",
        "PUBACKs received for outbox rows",
        rep.acknowledged,
    );
    let dead: Family<Reason, Counter> = Family::default();
    let unpublishable = rep.dead_lettered.saturating_sub(rep.refused + rep.isolated);
    for (reason, n) in [
        ("unpublishable", unpublishable),
        ("refused", rep.refused),
        ("poison", rep.isolated),
    ] {
        dead.get_or_create(&Reason { reason }).inc_by(n);
    }
    r.register(
        "relay_dead_lettered",
        "Outbox rows moved to the dead letters, by reason",
        dead,
    );
    counter(
        r,
        "relay_connections",
        "Successful connections of the publishing session",
        rep.connections,
    );
    counter(
        r,
        "relay_disconnects",
        "Connections of the publishing session lost (reconnects follow)",
        rep.disconnects,
    );
    r.register_with_unit(
        "relay_ack_latency",
        "From a message going on the wire to its PUBACK",
        Unit::Seconds,
        AckHistogram {
            buckets: rep.ack_latency_buckets.clone(),
            sum_micros: rep.ack_latency_sum_micros,
        },
    );
    counter(
        r,
        "relay_commands_received",
        "Command deliveries stored",
        rep.commands_received,
    );
    counter(
        r,
        "relay_commands_duplicate",
        "Command deliveries recognised as duplicates",
        rep.commands_duplicate,
    );
    counter(
        r,
        "relay_commands_applied",
        "Commands applied by the relay's handler",
        rep.commands_applied,
    );
    let failed: Family<Reason, Counter> = Family::default();
    for (reason, n) in [
        ("malformed", rep.commands_malformed),
        ("rejected", rep.commands_rejected),
        ("attempts_used_up", rep.commands_dead_lettered),
    ] {
        failed.get_or_create(&Reason { reason }).inc_by(n);
    }
    r.register(
        "relay_commands_failed",
        "Commands dead-lettered, by reason",
        failed,
    );
    counter(
        r,
        "relay_wal_syncs",
        "Syncs of the WAL file by the relay's durability barrier",
        rep.wal_syncs,
    );
    counter(
        r,
        "relay_database_steps",
        "SQLite virtual-machine steps run by the relay's publishing side: flat per published message however long the backlog",
        rep.database_steps,
    );
    if let Some(bytes) = rep.process_write_bytes {
        counter(
            r,
            "relay_process_write_bytes",
            "Bytes the relay's process caused to be written to storage",
            bytes,
        );
    }
    gauge(
        r,
        "relay_error",
        "1 while the relay is in an error (see edge-outbox status)",
        u64::from(rep.last_error.is_some()),
    );
    unix_seconds(
        r,
        "relay_started",
        "When the relay started (Unix time)",
        Some(rep.started_at_ms),
    );
    unix_seconds(
        r,
        "relay_disconnected_since",
        "Since when the publishing session has been down (Unix time; 0 while connected): alert on time() minus it",
        rep.disconnected_since_ms,
    );
    unix_seconds(
        r,
        "relay_last_ack",
        "When the broker last acknowledged a message (Unix time; 0 before the first): with messages pending, alert on time() minus it",
        rep.last_ack_ms,
    );
}

/// A time as a Prometheus gauge of Unix seconds, 0 for none.
fn unix_seconds(r: &mut Registry, name: &str, help: &str, ms: Option<i64>) {
    let g: Gauge<i64> = Gauge::default();
    g.set(ms.map_or(0, |ms| ms / 1000));
    r.register_with_unit(name, help, Unit::Seconds, g);
}

fn gauge(r: &mut Registry, name: &str, help: &str, value: u64) {
    let g: Gauge<i64> = Gauge::default();
    g.set(i64::try_from(value).unwrap_or(i64::MAX));
    r.register(name, help, g);
}

fn counter(r: &mut Registry, name: &str, help: &str, value: u64) {
    let c: Counter = Counter::default();
    c.inc_by(value);
    r.register(name, help, c);
}

/// The relay's PUBACK latency buckets as a Prometheus histogram.
#[derive(Debug)]
struct AckHistogram {
    buckets: Vec<(u64, u64)>,
    sum_micros: u64,
}

impl TypedMetric for AckHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for AckHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let mut buckets: Vec<(f64, u64)> = self
            .buckets
            .iter()
            .map(|&(bound, n)| {
                let le = if bound == u64::MAX {
                    f64::INFINITY
                } else {
                    bound as f64 / 1e6
                };
                (le, n)
            })
            .collect();
        if buckets.last().is_none_or(|b| b.0 != f64::INFINITY) {
            buckets.push((f64::INFINITY, 0));
        }
        let count = self.buckets.iter().map(|b| b.1).sum();
        encoder.encode_histogram::<NoLabelSet>(self.sum_micros as f64 / 1e6, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}
