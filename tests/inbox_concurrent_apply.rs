//! The check-then-act race of "exactly-once-and-the-outbox", Try it #2: two consumers that check
//! the inbox in one step and record the id in another can both apply a command. Here two workers,
//! each with its own connection, race on every command; the effect must happen exactly once.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::{TestResult, command_bytes, query_i64, temp_db};
use edge_outbox::{ApplyOutcome, Error, MessageId, Options, Outbox, Received, Synchronous};
use rusqlite::OptionalExtension;

const COMMANDS: i64 = 200;

fn options() -> Options {
    // NORMAL only for speed: the race is about the write lock, not about fsync.
    Options::new()
        .synchronous(Synchronous::Normal)
        .busy_timeout(Duration::from_secs(60))
}

fn create_account(outbox: &Outbox) -> Result<(), Error> {
    outbox.transaction(|tx| {
        tx.execute_batch(
            "CREATE TABLE account (balance INTEGER NOT NULL);
             INSERT INTO account VALUES (0);
             CREATE TABLE effects (command_id BLOB NOT NULL, worker INTEGER NOT NULL);",
        )?;
        Ok::<_, Error>(())
    })?;
    Ok(())
}

#[test]
fn two_workers_racing_on_each_command_apply_it_once() -> TestResult {
    let (_dir, path) = temp_db()?;
    let receiver = Outbox::open_with(&path, options())?;
    create_account(&receiver)?;

    // Three parties per round: the receiver stores command i, then both workers call apply_next
    // at the same moment, so both go for the same command.
    let start = Arc::new(Barrier::new(3));
    let end = Arc::new(Barrier::new(3));
    let workers: Vec<_> = (0..2)
        .map(|worker| {
            let outbox = Outbox::open_with(&path, options())?;
            let (start, end) = (Arc::clone(&start), Arc::clone(&end));
            Ok(std::thread::spawn(move || -> Result<Vec<ApplyOutcome>, Error> {
                let mut outcomes = Vec::new();
                for _ in 0..COMMANDS {
                    start.wait();
                    let outcome = outbox.apply_next(|tx, cmd| {
                        let amount: i64 = cmd.payload_as()?;
                        // Widen the window between reading the command and marking it applied.
                        std::thread::yield_now();
                        tx.execute("UPDATE account SET balance = balance + ?1", [amount])?;
                        tx.execute(
                            "INSERT INTO effects VALUES (?1, ?2)",
                            rusqlite::params![cmd.id.as_bytes(), worker],
                        )?;
                        Ok::<_, Error>(())
                    });
                    end.wait();
                    outcomes.push(outcome?);
                }
                Ok(outcomes)
            }))
        })
        .collect::<Result<_, Error>>()?;

    let mut ids = Vec::new();
    for i in 0..COMMANDS {
        let id = MessageId::new_v7();
        let received = receiver.receive("commands/credit", &command_bytes(id, "account", &(i + 1))?)?;
        assert_eq!(received, Received::Stored(id));
        ids.push(id);
        start.wait();
        end.wait();
    }
    let mut per_worker = Vec::new();
    for w in workers {
        per_worker.push(w.join().map_err(|_| "worker panicked")??);
    }

    let mut applied_by = [0usize; 2];
    for (round, id) in ids.iter().enumerate() {
        let applied: Vec<usize> = (0..2)
            .filter(|&w| match &per_worker[w][round] {
                ApplyOutcome::Applied { id: got, published } => {
                    assert_eq!((got, *published), (id, 0));
                    true
                }
                ApplyOutcome::Idle { next_due: None } => false,
                other => panic!("round {round}: worker {w} got {other:?}"),
            })
            .collect();
        assert_eq!(
            applied.len(),
            1,
            "round {round}: command applied by workers {applied:?}"
        );
        applied_by[applied[0]] += 1;
    }
    eprintln!("commands applied per worker: {applied_by:?}");

    let expected: i64 = (1..=COMMANDS).sum();
    assert_eq!(query_i64(&receiver, "SELECT balance FROM account")?, expected);
    assert_eq!(query_i64(&receiver, "SELECT count(*) FROM effects")?, COMMANDS);
    assert_eq!(
        query_i64(&receiver, "SELECT count(DISTINCT command_id) FROM effects")?,
        COMMANDS
    );
    let stats = receiver.stats()?;
    assert_eq!((stats.inbox_applied, stats.inbox_unapplied), (COMMANDS as u64, 0));
    Ok(())
}

#[test]
fn workers_draining_a_backlog_apply_each_command_once() -> TestResult {
    let (_dir, path) = temp_db()?;
    let receiver = Outbox::open_with(&path, options())?;
    create_account(&receiver)?;
    for i in 0..COMMANDS {
        // Several keys, so both workers have commands they may take at the same time.
        let key = format!("account-{}", i % 4);
        receiver.receive(
            "commands/credit",
            &command_bytes(MessageId::new_v7(), &key, &(i + 1))?,
        )?;
    }

    let start = Arc::new(Barrier::new(3));
    let workers: Vec<_> = (0..3)
        .map(|worker| {
            let outbox = Outbox::open_with(&path, options())?;
            let start = Arc::clone(&start);
            Ok(std::thread::spawn(move || -> Result<u64, Error> {
                start.wait();
                let mut applied = 0;
                loop {
                    match outbox.apply_next(|tx, cmd| {
                        let amount: i64 = cmd.payload_as()?;
                        tx.execute("UPDATE account SET balance = balance + ?1", [amount])?;
                        tx.execute(
                            "INSERT INTO effects VALUES (?1, ?2)",
                            rusqlite::params![cmd.id.as_bytes(), worker],
                        )?;
                        Ok::<_, Error>(())
                    })? {
                        ApplyOutcome::Applied { .. } => applied += 1,
                        ApplyOutcome::Idle { next_due: None } => return Ok(applied),
                        other => return Err(Error::InvalidConfig(format!("unexpected {other:?}"))),
                    }
                }
            }))
        })
        .collect::<Result<_, Error>>()?;
    let mut total = 0;
    for w in workers {
        total += w.join().map_err(|_| "worker panicked")??;
    }
    assert_eq!(total, COMMANDS as u64);
    assert_eq!(
        query_i64(&receiver, "SELECT balance FROM account")?,
        (1..=COMMANDS).sum::<i64>()
    );
    assert_eq!(
        query_i64(&receiver, "SELECT count(DISTINCT command_id) FROM effects")?,
        COMMANDS
    );
    // Per key, commands were applied in arrival order.
    let out_of_order = query_i64(
        &receiver,
        "SELECT count(*) FROM inbox a JOIN inbox b ON a.key = b.key AND a.seq < b.seq
         WHERE a.applied_at > b.applied_at",
    )?;
    assert_eq!(out_of_order, 0);
    Ok(())
}

/// A handler in another process follows the SQL contract of docs/schema.md: in one IMMEDIATE
/// transaction, do the effect, then mark the command applied with an update that must change
/// exactly one row; if it changed none, another worker got there first, so roll back.
#[test]
fn foreign_workers_following_the_sql_contract_apply_once() -> TestResult {
    let (_dir, path) = temp_db()?;
    let receiver = Outbox::open_with(&path, options())?;
    create_account(&receiver)?;
    for i in 0..50 {
        receiver.receive(
            "commands/credit",
            &command_bytes(MessageId::new_v7(), "account", &(i + 1))?,
        )?;
    }

    let start = Arc::new(Barrier::new(2));
    let workers: Vec<_> = (0..2)
        .map(|worker| {
            let path = path.clone();
            let start = Arc::clone(&start);
            std::thread::spawn(move || -> rusqlite::Result<(u64, u64)> {
                let mut conn = rusqlite::Connection::open(path)?;
                conn.busy_timeout(Duration::from_secs(60))?;
                start.wait();
                let (mut applied, mut lost_race) = (0, 0);
                loop {
                    // Pick a candidate outside the transaction, as a naive poller would: the
                    // other worker may apply it before we take the lock.
                    let next: Option<(i64, Vec<u8>, Vec<u8>)> = conn
                        .query_row(
                            "SELECT seq, id, payload FROM inbox
                             WHERE applied_at IS NULL AND dead_at IS NULL ORDER BY seq LIMIT 1",
                            [],
                            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                        )
                        .optional()?;
                    let Some((seq, id, payload)) = next else { break };
                    let amount: i64 = ciborium::from_reader(&payload[..]).map_err(|e| {
                        rusqlite::Error::ToSqlConversionFailure(Box::new(std::io::Error::other(e.to_string())))
                    })?;
                    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                    tx.execute("UPDATE account SET balance = balance + ?1", [amount])?;
                    tx.execute("INSERT INTO effects VALUES (?1, ?2)", rusqlite::params![id, worker])?;
                    let marked = tx.execute(
                        "UPDATE inbox SET applied_at = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER),
                                          payload = NULL
                         WHERE seq = ?1 AND applied_at IS NULL AND dead_at IS NULL",
                        [seq],
                    )?;
                    if marked == 1 {
                        tx.commit()?;
                        applied += 1;
                    } else {
                        tx.rollback()?;
                        lost_race += 1;
                    }
                }
                Ok((applied, lost_race))
            })
        })
        .collect();
    let mut applied = 0;
    for w in workers {
        let (a, lost) = w.join().map_err(|_| "worker panicked")??;
        eprintln!("foreign worker: applied {a}, lost the race {lost} times");
        applied += a;
    }
    assert_eq!(applied, 50);
    assert_eq!(
        query_i64(&receiver, "SELECT balance FROM account")?,
        (1..=50).sum::<i64>()
    );
    assert_eq!(query_i64(&receiver, "SELECT count(*) FROM effects")?, 50);
    assert_eq!(receiver.stats()?.inbox_applied, 50);
    Ok(())
}
