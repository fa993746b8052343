//! The work of a write does not grow with what the file already holds, counted in SQLite's own
//! virtual-machine steps (a progress handler called at every step), not timed: the coalescing
//! trigger's replacement, an insert that evicts at the storage limit, and a command's receive
//! (stored, or refused as a duplicate) each cost the same beside 1,000 or 100,000 rows.
//!
//! Broken builds these catch: a trigger or an eviction whose WHERE no longer matches its partial
//! index (`outbox_coalescing`, `outbox_evictable`: it then scans the outbox), and an inbox
//! whose duplicate check or insert scans the table.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::{TestResult, command_bytes, temp_db};
use edge_outbox::{Error, Limits, Message, MessageId, OnFull, Options, Outbox, Received};

const SIZES: [u64; 3] = [1_000, 10_000, 100_000];
/// Writes measured beside each backlog.
const WRITES: u64 = 200;
/// How much more a write may cost beside the largest backlog than beside the smallest: a deeper
/// B-tree costs a seek no more steps, so this only absorbs page splits. A scan costs the backlog.
const SLACK: f64 = 1.5;

/// Counts every step SQLite runs on the handle's connection from now on.
fn count_steps(outbox: &Outbox) -> Arc<AtomicU64> {
    let steps = Arc::new(AtomicU64::new(0));
    let counter = steps.clone();
    outbox.with_connection(|c| {
        c.progress_handler(
            1,
            Some(move || {
                counter.fetch_add(1, Ordering::Relaxed);
                false
            }),
        )
    });
    steps
}

/// Fills a store with `backlog` rows by `fill`, then runs `write` [`WRITES`] times under the
/// step counter; the steps per write.
fn steps_per_write(
    options: Options,
    backlog: u64,
    fill: impl Fn(&Outbox, u64) -> TestResult,
    write: impl Fn(&Outbox, u64) -> TestResult,
) -> TestResult<f64> {
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open_with(&db, options)?;
    fill(&outbox, backlog)?;
    let steps = count_steps(&outbox);
    for i in 0..WRITES {
        write(&outbox, i)?;
    }
    Ok(steps.load(Ordering::Relaxed) as f64 / WRITES as f64)
}

fn check_flat(name: &str, per_size: impl Fn(u64) -> TestResult<f64>) -> TestResult {
    let mut per_write = Vec::new();
    for backlog in SIZES {
        per_write.push(per_size(backlog)?);
    }
    let figures: Vec<String> = SIZES
        .iter()
        .zip(&per_write)
        .map(|(n, s)| format!("{n}: {s:.1}"))
        .collect();
    println!(
        "{name}: SQLite steps per write by rows held: {}",
        figures.join(", ")
    );
    let (smallest, largest) = (per_write[0], per_write[SIZES.len() - 1]);
    assert!(smallest > 0.0, "{name}: no steps were counted");
    assert!(
        largest <= smallest * SLACK,
        "{name}: the work per write grows with the rows held ({})",
        figures.join(", ")
    );
    Ok(())
}

fn reading(key: u64, value: u64) -> Result<Message, Error> {
    Ok(Message::new("sensors/t", format!("s{key}"), &value)?.coalescing(true))
}

#[test]
fn a_coalescing_write_replaces_its_predecessor_at_the_same_cost_beside_any_backlog() -> TestResult {
    check_flat("coalescing", |backlog| {
        steps_per_write(
            Options::new(),
            backlog,
            |outbox, n| {
                outbox.transaction(|tx| {
                    for key in 0..n {
                        tx.send(&reading(key, 0)?)?;
                    }
                    Ok::<_, Error>(())
                })?;
                Ok(())
            },
            |outbox, i| {
                // Replaces the pending reading of a sensor spread over the backlog.
                let key = i * (backlog / WRITES);
                outbox.transaction(|tx| tx.send(&reading(key, 1)?))?;
                Ok(())
            },
        )
    })
}

#[test]
fn a_write_at_the_storage_limit_evicts_the_oldest_at_the_same_cost_beside_any_backlog() -> TestResult {
    check_flat("eviction", |backlog| {
        let limits = Limits::new()
            .max_pending_messages(backlog)
            .on_full(OnFull::EvictOldest);
        steps_per_write(
            Options::new().limits(limits),
            backlog,
            |outbox, n| {
                outbox.transaction(|tx| {
                    // Alarms first, which never make room: the eviction passes over them.
                    for i in 0..n / 2 {
                        tx.send(&Message::new("alarms/a", "a", &i)?.priority(3))?;
                    }
                    for i in n / 2..n {
                        tx.send(&Message::new("telemetry/t", "t", &i)?.evictable(true))?;
                    }
                    Ok::<_, Error>(())
                })?;
                Ok(())
            },
            |outbox, i| {
                outbox.transaction(|tx| tx.send(&Message::new("telemetry/t", "t", &i)?.evictable(true)))?;
                Ok(())
            },
        )
    })
}

#[test]
fn a_command_is_received_and_a_redelivery_refused_at_the_same_cost_beside_any_inbox() -> TestResult {
    check_flat("inbox receive", |backlog| {
        let fresh = std::cell::RefCell::new(Vec::new());
        steps_per_write(
            Options::new(),
            backlog,
            |outbox, n| {
                outbox.transaction(|tx| {
                    let mut stmt = tx.prepare(
                        "INSERT INTO inbox (id, topic, key, applied_at) VALUES (?1, 'commands/c', 'k', 1)",
                    )?;
                    for _ in 0..n {
                        stmt.execute([MessageId::new_v7().as_bytes().to_vec()])?;
                    }
                    Ok::<_, Error>(())
                })?;
                Ok(())
            },
            |outbox, i| {
                // Every other write is the redelivery of the one before it.
                if i % 2 == 0 {
                    let bytes = command_bytes(MessageId::new_v7(), "k", &i)?;
                    assert!(matches!(
                        outbox.receive("commands/c", &bytes)?,
                        Received::Stored(_)
                    ));
                    fresh.borrow_mut().push(bytes);
                } else {
                    let bytes = fresh.borrow_mut().pop().ok_or("no command to redeliver")?;
                    assert!(matches!(
                        outbox.receive("commands/c", &bytes)?,
                        Received::Duplicate(_)
                    ));
                }
                Ok(())
            },
        )
    })
}
