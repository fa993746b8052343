//! The disk itself refuses: ENOSPC and EIO from the file system (the power-cut FUSE file system,
//! told to fail), while a relay publishes. Every commit that returned is delivered; every one that
//! failed left nothing, and said why; once the disk works again, so does the store.

mod support;

use std::time::Duration;

use edge_outbox::{Error, MessageId, Outbox, Relay};
use support::device::relay_config;
use support::powercut::{Fault, PowerCutFs};
use support::{Broker, Subscriber, WAIT, check};

/// Commits orders until one fails (or `max` succeed); returns the committed ids and the error.
fn commit_until_error(outbox: &Outbox, from: usize, max: usize) -> (Vec<(MessageId, String)>, Option<Error>) {
    let mut committed = Vec::new();
    for i in from..from + max {
        let key = if i % 2 == 0 { "a" } else { "b" };
        // Large enough that a page fills quickly: ENOSPC needs the file to grow.
        let payload = vec![i as u8; 3000];
        let result = outbox.transaction(|tx| {
            tx.execute("INSERT INTO orders (key) VALUES (?1)", [key])?;
            tx.publish(&format!("orders/{key}"), key, &(i as u64, key, &payload))
        });
        match result {
            Ok(c) => committed.push((c.value, key.to_owned())),
            Err(e) => return (committed, Some(e)),
        }
    }
    (committed, None)
}

fn orders(outbox: &Outbox) -> i64 {
    outbox
        .with_connection(|c| c.query_row("SELECT count(*) FROM orders", [], |r| r.get(0)))
        .expect("count orders")
}

fn messages(outbox: &Outbox) -> i64 {
    outbox
        .with_connection(|c| {
            c.query_row(
                "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_sent)",
                [],
                |r| r.get(0),
            )
        })
        .expect("count messages")
}

#[test]
#[cfg_attr(
    eo_skip_fuse,
    ignore = "needs FUSE: /dev/fuse, and root or fusermount3 (the build warning says why)"
)]
fn enospc_and_eio_from_the_disk_fail_the_write_and_lose_nothing() {
    let fs = PowerCutFs::mount().expect("mount");
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    // Sent rows are kept, so that rows and messages can be counted together at every step.
    let options = edge_outbox::Options::new().sent_retention(Duration::from_secs(3600));
    let outbox = Outbox::open_with(fs.path().join("device.db"), options).expect("open");
    outbox
        .with_connection(|c| {
            c.execute_batch("CREATE TABLE orders (n INTEGER PRIMARY KEY, key TEXT NOT NULL)")
        })
        .expect("business table");
    let relay = Relay::start(&outbox, relay_config(broker.addr(), "disk-errors")).expect("relay");
    let mut committed = commit_until_error(&outbox, 0, 50).0;

    for (fault, i) in [(Fault::NoSpace, 1000), (Fault::Io, 2000)] {
        fs.set_fault(Some(fault));
        let (more, error) = commit_until_error(&outbox, i, 500);
        committed.extend(more);
        let error = error.unwrap_or_else(|| panic!("{fault:?}: 500 commits and none failed"));
        eprintln!("{fault:?}: {error}");
        match fault {
            Fault::NoSpace => assert!(matches!(error, Error::DiskFull), "{fault:?}: {error:?}"),
            Fault::Io => assert!(matches!(error, Error::DiskIo(..)), "{fault:?}: {error:?}"),
            Fault::SlowSync(_) => unreachable!("not among this test's faults"),
        }
        // The failed transaction left nothing: a row and its message, or neither.
        assert_eq!(orders(&outbox), committed.len() as i64, "{fault:?}: rows");
        assert_eq!(messages(&outbox), committed.len() as i64, "{fault:?}: messages");
        fs.set_fault(None);
        // Writing works again, without reopening anything.
        let (more, error) = commit_until_error(&outbox, i + 500, 20);
        assert!(error.is_none(), "after {fault:?} was cleared: {error:?}");
        committed.extend(more);
    }
    check::wait_and_check(&sub, &committed, WAIT).expect("every commit that returned was delivered");
    relay.shutdown().expect("shutdown");
}
