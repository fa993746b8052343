//! Files a device meets in the field: one locked by another process, one on a read-only file
//! system. Each gives a clear error, never a panic, and loses nothing.

use std::time::Duration;

use edge_outbox::{Error, Options, Outbox};

#[test]
fn a_file_locked_by_another_writer_gives_busy_then_works_once_released() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("locked.db");
    Outbox::open(&path).expect("create");
    // Another process's long write transaction (a plain connection, as any program would have).
    let other = rusqlite::Connection::open(&path).expect("other");
    other
        .execute_batch("BEGIN IMMEDIATE; CREATE TABLE theirs (x)")
        .expect("lock");

    let outbox = Outbox::open_with(&path, Options::new().busy_timeout(Duration::from_millis(100)))
        .expect("opening needs no write lock");
    let err = outbox
        .transaction(|tx| tx.publish("t", "k", &1))
        .expect_err("busy");
    assert!(matches!(err, Error::Busy), "{err:?}");
    assert!(err.to_string().contains("locked"), "{err}");
    assert!(outbox.stats().expect("reads still work").pending_messages == 0);

    other.execute_batch("COMMIT").expect("release");
    outbox
        .transaction(|tx| tx.publish("t", "k", &1))
        .expect("works once released");
    assert_eq!(outbox.stats().expect("stats").pending_messages, 1);
}

#[test]
#[cfg_attr(
    eo_skip_mount,
    ignore = "needs root to mount a tmpfs (the build warning says why)"
)]
fn a_read_only_file_system_gives_a_clear_error_and_keeps_what_was_there() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mnt = dir.path().join("ro");
    std::fs::create_dir(&mnt).expect("mount point");
    // A real read-only file system: a tmpfs remounted read-only (root only; permission bits do
    // not stop root, so they would prove nothing here).
    let mount = |args: &[&str]| {
        std::process::Command::new("mount")
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !mount(&[
        "-t",
        "tmpfs",
        "-o",
        "size=8m",
        "tmpfs",
        mnt.to_str().expect("utf-8 path"),
    ]) {
        panic!(
            "cannot mount a tmpfs on {}, though build.rs found root",
            mnt.display()
        );
    }
    let path = mnt.join("device.db");
    {
        let outbox = Outbox::open(&path).expect("create");
        outbox
            .transaction(|tx| tx.publish("t", "k", &"kept"))
            .expect("commit");
    }
    let remounted = mount(&["-o", "remount,ro", mnt.to_str().expect("utf-8 path")]);
    let result = std::panic::catch_unwind(|| {
        assert!(remounted, "remount read-only");
        match Outbox::open(&path) {
            Err(e) => {
                let text = e.to_string();
                assert!(
                    text.contains("read-only") || text.contains("readonly"),
                    "unclear error: {text}"
                );
                // What was committed is still there, readable without writing anything.
                let uri = format!("file:{}?immutable=1", path.display());
                let flags = rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_URI;
                let conn = rusqlite::Connection::open_with_flags(uri, flags).expect("read-only open");
                let kept: i64 = conn
                    .query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))
                    .expect("count");
                assert_eq!(kept, 1, "nothing lost");
            }
            Ok(outbox) => {
                // SQLite may open it for reading; then the first write says why it failed.
                assert_eq!(
                    outbox.stats().expect("reads work").pending_messages,
                    1,
                    "nothing lost"
                );
                let err = outbox
                    .transaction(|tx| tx.publish("t", "k", &2))
                    .expect_err("read-only");
                let text = err.to_string();
                assert!(
                    text.contains("read-only") || text.contains("readonly"),
                    "unclear error: {text}"
                );
            }
        }
    });
    let _ = std::process::Command::new("umount").arg(&mnt).status();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}
