//! `edge-outbox consume`: the cloud's view of a fleet, for field tests. Subscribes, feeds every
//! item to the consumer module, and prints a table per device (source and epoch): delivered,
//! duplicates, gaps the devices announced (by cause), gaps nobody announced (lost on the way).

use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use clap::Args;
use crossbeam_channel::RecvTimeoutError;
use edge_outbox::consumer::{Consumer, Report};
use serde_json::json;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::broker_args::BrokerArgs;
use crate::exit::{CliError, Code};
use crate::{Global, Result, output};

#[derive(Debug, Args)]
#[command(after_help = "\
Every item on the topics is decoded as an edge-outbox envelope or gap notice (docs/wire-format.md) \
and counted per source and epoch. A gap is a sequence number neither delivered nor announced by \
its device; it counts as unexplained once it has been missing for --grace seconds (late messages \
and notices may still fill it). Subscribe to every topic the devices publish on: their numbering \
counts them all.

Runs until SIGINT or SIGTERM, for --for seconds, or until --stop-after items arrived, then prints \
the final table (or JSON with --json). Exit codes: 0, or 6 with --fail-on-gap when a gap is unexplained at the end; 2 for bad \
arguments.")]
pub struct ConsumeArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Topic filter to subscribe to (repeat for several).
    #[arg(long, value_name = "FILTER", required = true)]
    pub topic: Vec<String>,
    /// Client id. With one, the session is persistent (the broker keeps what arrives while this
    /// is not running); without, a fresh session with a random id.
    #[arg(long, value_name = "ID")]
    pub client_id: Option<String>,
    /// Exit with code 6 if any gap is unexplained at the end.
    #[arg(long)]
    pub fail_on_gap: bool,
    /// Seconds a gap may stay open before it counts as unexplained.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub grace: u64,
    /// Devices seen for the first time should have started at 1 (this consumer has been there
    /// since their first message); otherwise each is counted from the first number seen.
    #[arg(long)]
    pub from_start: bool,
    /// Stop after this many seconds.
    #[arg(long = "for", value_name = "SECS")]
    pub duration: Option<u64>,
    /// Stop once this many items (messages and gap notices, duplicates included) have arrived.
    #[arg(long, value_name = "N")]
    pub stop_after: Option<u64>,
    /// Seconds between tables while running.
    #[arg(long, value_name = "SECS", default_value_t = 5)]
    pub interval: u64,
}

pub fn run(global: &Global, args: &ConsumeArgs) -> Result<()> {
    let client_id = args
        .client_id
        .clone()
        .unwrap_or_else(|| format!("edge-outbox-consume-{}", edge_outbox::MessageId::new_v7()));
    let mqtt = args.broker.mqtt(None)?.client_id(&client_id);
    for filter in &args.topic {
        if filter.is_empty() {
            return Err(CliError::usage("--topic must not be empty"));
        }
    }
    let signals = Signals::new([SIGINT, SIGTERM])
        .map_err(|e| CliError::runtime(format!("installing signal handlers: {e}")))?;
    let signal_handle = signals.handle();
    let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
    let (items_tx, items) = crossbeam_channel::bounded::<Vec<u8>>(10_000);
    let persistent = args.client_id.is_some();
    let filters = args.topic.clone();
    let subscriber = std::thread::Builder::new()
        .name("edge-outbox-consume".into())
        .spawn(move || {
            edge_outbox::subscribe(&mqtt, &filters, persistent, &stop_rx, |_, payload| {
                let _ = items_tx.send(payload.to_vec());
            })
        })
        .map_err(|e| CliError::runtime(format!("spawning the subscriber: {e}")))?;
    let (sig_tx, sig_rx) = crossbeam_channel::bounded::<()>(1);
    let waiter = std::thread::spawn(move || {
        let mut signals = signals;
        if signals.forever().next().is_some() {
            let _ = sig_tx.send(());
        }
    });

    let mut consumer = Consumer::new().from_start(args.from_start);
    let grace = Duration::from_secs(args.grace);
    let tty = std::io::stdout().is_terminal();
    let deadline = args.duration.map(|s| Instant::now() + Duration::from_secs(s));
    let interval = Duration::from_secs(args.interval.max(1));
    let mut next_table = Instant::now() + interval;
    let mut malformed = 0u64;
    let mut received = 0u64;
    loop {
        if deadline.is_some_and(|d| Instant::now() >= d)
            || args.stop_after.is_some_and(|n| received >= n)
            || sig_rx.try_recv().is_ok()
            || subscriber.is_finished()
        {
            break;
        }
        match items.recv_timeout(Duration::from_millis(200)) {
            Ok(bytes) => {
                received += 1;
                if consumer.observe_all(&bytes).is_err() {
                    malformed += 1;
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if Instant::now() >= next_table && !global.json {
            next_table = Instant::now() + interval;
            let clear = if tty { "\x1b[2J\x1b[H" } else { "" };
            output::print(&format!(
                "{clear}{}",
                table(&consumer.report_after(grace), malformed)
            ))?;
        }
    }
    drop(stop_tx);
    signal_handle.close();
    let _ = waiter.join();
    match subscriber.join() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => return Err(CliError::runtime("the subscriber thread panicked")),
    }
    // What was still queued when the subscriber stopped.
    for bytes in items.try_iter() {
        if consumer.observe_all(&bytes).is_err() {
            malformed += 1;
        }
    }
    let report = consumer.report_after(grace);
    if global.json {
        output::print_json(&to_json(&report, malformed))?;
    } else {
        output::print(&table(&report, malformed))?;
    }
    if args.fail_on_gap && report.totals.unexplained > 0 {
        return Err(CliError::new(
            Code::UnexplainedGaps,
            format!(
                "{} messages missing without a gap notice (lost after the devices handed them to the broker: see docs/reliability.md)",
                report.totals.unexplained
            ),
        ));
    }
    Ok(())
}

fn table(report: &Report, malformed: u64) -> String {
    let mut out = report.to_string();
    if malformed > 0 {
        out.push_str(&format!("{malformed} items were not edge-outbox envelopes\n"));
    }
    out
}

fn to_json(report: &Report, malformed: u64) -> serde_json::Value {
    json!({
        "streams": report.streams.iter().map(|s| json!({
            "source": s.source,
            "epoch": s.epoch,
            "first": s.first,
            "last": s.last,
            "delivered": s.delivered,
            "duplicates": s.duplicates,
            "late": s.late,
            "reordered": s.reordered,
            "announced": s.announced,
            "announced_by_cause": s.announced_by_cause,
            "unexplained": s.unexplained_count(),
            "unexplained_ranges": s.unexplained,
            "forgotten": s.forgotten,
            "unplaced": s.unplaced,
        })).collect::<Vec<_>>(),
        "totals": {
            "delivered": report.totals.delivered,
            "duplicates": report.totals.duplicates,
            "late": report.totals.late,
            "reordered": report.totals.reordered,
            "announced": report.totals.announced,
            "unexplained": report.totals.unexplained,
        },
        "malformed": malformed,
    })
}
