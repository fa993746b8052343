//! Epochs: which numbering a message's `seq` belongs to.
//!
//! Each (source, epoch) numbers its messages 1, 2, 3, ... in commit order, so the cloud can tell
//! a missing message from one not yet sent. An epoch covers the outbox rows from its `first_seq`
//! up to the next epoch's: the wire `seq` is `outbox.seq - first_seq + 1`. A new epoch starts
//! whenever the numbering may repeat numbers the cloud has already seen with other messages:
//! when the schema is created, when the file turns out to be a copy (a backup restored over the
//! device's database, whose counter is behind what was published since), and after a salvage.
//!
//! A copy is told two ways. A file that is not the one last opened here (another inode, another
//! creation time: removed and copied back, cloned to another device) is `copied`. A file whose
//! counter is behind what the relay had acknowledged from this path (`super::published`, kept
//! beside the file) is `restored`: a backup copied back in place, which keeps the inode and the
//! creation time.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::error::Result;

/// The epochs of a store, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Epochs {
    /// `(first_seq, epoch)`, by `first_seq`.
    list: Vec<(i64, u64)>,
}

impl Epochs {
    pub(crate) fn read(conn: &Connection) -> Result<Epochs> {
        let mut stmt =
            conn.prepare_cached("SELECT first_seq, epoch FROM edge_outbox_epochs ORDER BY first_seq")?;
        let list = stmt
            .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?
            .map(|row| row.map(|(first, epoch)| (first, u64::try_from(epoch).unwrap_or(0))))
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(Epochs { list })
    }

    /// The epoch of outbox row `seq` and its number within that epoch (from 1).
    pub(crate) fn locate(&self, seq: i64) -> (u64, u64) {
        let i = self.list.partition_point(|&(first, _)| first <= seq);
        match i.checked_sub(1).and_then(|i| self.list.get(i)) {
            Some(&(first, epoch)) => (epoch, u64::try_from(seq - first + 1).unwrap_or(0)),
            // Below every epoch: cannot happen (the first starts at 1); no epoch, the raw number.
            None => (0, u64::try_from(seq).unwrap_or(0)),
        }
    }
}

/// The current epoch of the store `conn` is on (0 before schema version 5).
pub(crate) fn current(conn: &Connection) -> Result<u64> {
    let epoch: Option<i64> = conn
        .query_row(
            "SELECT epoch FROM edge_outbox_epochs ORDER BY first_seq DESC LIMIT 1",
            [],
            |r| r.get(0),
        )
        .optional()?;
    Ok(epoch.and_then(|e| u64::try_from(e).ok()).unwrap_or(0))
}

/// The highest sequence number the store has used: given to a row, or recorded in a gap.
fn highest_used(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row(
        "SELECT max(
             coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'outbox'), 0),
             coalesce((SELECT max(seq) FROM outbox), 0),
             coalesce((SELECT max(coalesce(last_seq, seq)) FROM outbox_gaps), 0))",
        [],
        |r| r.get(0),
    )?)
}

/// Starts a new epoch after every sequence number used so far, in the caller's transaction.
/// Returns it.
pub(crate) fn start(conn: &Connection, reason: &str) -> Result<u64> {
    let next = highest_used(conn)? + 1;
    // An epoch that numbered nothing yet is simply replaced.
    conn.execute("DELETE FROM edge_outbox_epochs WHERE first_seq >= ?1", [next])?;
    let epoch: i64 = conn.query_row(
        "INSERT INTO edge_outbox_epochs (epoch, first_seq, reason)
         VALUES (max(1, random() & 0x7FFFFFFFFFFFFFFF), ?1, ?2) RETURNING epoch",
        params![next, reason],
        |r| r.get(0),
    )?;
    Ok(u64::try_from(epoch).unwrap_or(0))
}

/// What identifies the file itself rather than its contents: its inode number and creation time.
/// A backup copied back (even over the same name, even onto a recycled inode number) has a new
/// creation time. `None` where the platform tells neither.
fn file_identity(path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&meta).to_string();
    #[cfg(not(unix))]
    let inode = String::from("-");
    let born = meta
        .created()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or_else(|| "-".to_owned(), |d| d.as_nanos().to_string());
    if inode == "-" && born == "-" {
        return None;
    }
    Some(format!("{inode}:{born}"))
}

/// Starts a new epoch when the file at `path` is a copy: not the one this store was last opened
/// as (restored from a backup, cloned to another device), or behind what the relay published from
/// this path (a backup restored in place); remembers the file. Takes the write lock only when
/// something changes.
pub(crate) fn check_file(conn: &mut Connection, path: &Path) -> Result<()> {
    let identity = file_identity(path);
    let published = super::published::read(path).filter(|_| !crate::mutant::active("skip-published-check"));
    let read = |c: &Connection| -> rusqlite::Result<Option<String>> {
        c.query_row(
            "SELECT value FROM edge_outbox_meta WHERE name = 'file_id'",
            [],
            |r| r.get(0),
        )
        .optional()
    };
    let same_file = |stored: Option<&str>| identity.is_none() || stored == identity.as_deref();
    let behind = |c: &Connection| -> Result<Option<i64>> {
        let Some(published) = published else {
            return Ok(None);
        };
        let high = highest_used(c)?;
        Ok((high < published).then_some(high))
    };
    if same_file(read(conn)?.as_deref()) && behind(conn)?.is_none() {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let stored = read(&tx)?;
    let behind_at = behind(&tx)?;
    if same_file(stored.as_deref()) && behind_at.is_none() {
        return Ok(());
    }
    if stored.is_some() && !same_file(stored.as_deref()) {
        let epoch = start(&tx, "copied")?;
        tracing::warn!(
            path = %path.display(),
            epoch,
            "this database file is a copy of the one last opened here (restored from a backup?): \
             numbering messages in a new epoch, so the cloud cannot mistake them for ones it has"
        );
    } else if let Some(high) = behind_at {
        let epoch = start(&tx, "restored")?;
        tracing::warn!(
            path = %path.display(),
            epoch,
            high,
            published = published.unwrap_or(0),
            "this database file is behind what was published from it (a backup restored in \
             place?): numbering messages in a new epoch, so the cloud cannot mistake them for ones \
             it has"
        );
    }
    if let Some(identity) = &identity {
        tx.execute(
            "INSERT INTO edge_outbox_meta (name, value) VALUES ('file_id', ?1)
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            [identity],
        )?;
    }
    tx.commit()?;
    if let Some(high) = behind_at {
        // Numbers from the counter on are the new epoch's: the watermark starts again there. A
        // failure here only starts one more (empty) epoch at the next open.
        if let Err(e) = super::published::write(path, high) {
            tracing::warn!(error = %e, "could not reset the published watermark");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Epochs;

    #[test]
    fn rows_map_to_their_epoch_counting_from_one() {
        let epochs = Epochs {
            list: vec![(1, 11), (100, 22), (250, 33)],
        };
        assert_eq!(epochs.locate(1), (11, 1));
        assert_eq!(epochs.locate(99), (11, 99));
        assert_eq!(epochs.locate(100), (22, 1));
        assert_eq!(epochs.locate(249), (22, 150));
        assert_eq!(epochs.locate(1000), (33, 751));
    }
}
