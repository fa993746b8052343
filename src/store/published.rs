//! How far the cloud may have this store's numbers, kept beside the database file
//! (`<db>.published`), where a backup copied back over the file does not reach.
//!
//! Everything inside the file is restored with it, so nothing inside can tell a restored file
//! from the one last written here, and a restore in place (`cp backup.db device.db`, SQLite's
//! `.restore`) keeps the inode and creation time the copy check looks at. What gives a restored
//! file away is its counter: behind numbers the relay has already had acknowledged. The relay's
//! marker raises this watermark as rows and gap notices are acknowledged; opening a store whose
//! counter is below it starts a new epoch (`epoch::check_file`).
//!
//! The file holds one outbox `seq` as fixed-width decimal text, overwritten in place: no rename
//! per write, and repeated writes between two writebacks of the file system cost one block. It
//! is synced when the marker stops, not per write: after a power cut it may be behind by what was
//! acknowledged since the last writeback, a window in which a restore goes unnoticed. A torn or
//! unreadable file disables the check (logged), never the store.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The watermark file of the database at `db`.
pub(crate) fn path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push(".published");
    PathBuf::from(name)
}

/// The watermark of `db`: the highest outbox `seq` acknowledged from it. `None` when there is
/// none (no relay has published from this path yet) or it is unreadable.
pub(crate) fn read(db: &Path) -> Option<i64> {
    let file = path(db);
    let text = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %file.display(), error = %e, "unreadable: a restored backup goes unnoticed");
            return None;
        }
    };
    let parsed = text.trim().parse::<i64>().ok();
    if parsed.is_none() {
        tracing::warn!(path = %file.display(), "not a sequence number: a restored backup goes unnoticed");
    }
    parsed
}

/// Sets the watermark of `db` to `seq` (lowering it too: after a new epoch, numbers from the
/// file's counter on are new).
pub(crate) fn write(db: &Path, seq: i64) -> std::io::Result<()> {
    let mut file = open_private(&path(db), true)?;
    file.write_all(&line(seq))?;
    file.sync_data()
}

/// Opens (creating) the watermark file for writing, readable by the owner only, like the
/// database beside it.
fn open_private(path: &Path, truncate: bool) -> std::io::Result<File> {
    let mut open = std::fs::OpenOptions::new();
    open.write(true).create(true).truncate(truncate);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    open.open(path)
}

/// The file's length: twenty digits and a newline.
const LEN: u64 = 21;

/// Fixed width, so that an overwrite in place never leaves a longer number's tail behind.
fn line(seq: i64) -> [u8; LEN as usize] {
    let mut out = [b'\n'; LEN as usize];
    let text = format!("{:020}", seq.max(0));
    for (o, b) in out.iter_mut().zip(text.bytes()) {
        *o = b;
    }
    out
}

/// The marker's side: raises the watermark as rows are acknowledged.
#[derive(Debug)]
pub(crate) struct Watermark {
    db: PathBuf,
    file: Option<File>,
    high: i64,
}

impl Watermark {
    /// The watermark of `db`, as it is.
    pub(crate) fn new(db: &Path) -> Self {
        Watermark {
            db: db.to_path_buf(),
            file: None,
            high: read(db).unwrap_or(0),
        }
    }

    /// Notes that `seq` was acknowledged; written now if it raises the watermark. A failed write
    /// is logged: the relay publishes on, only a restore would go unnoticed.
    pub(crate) fn raise(&mut self, seq: i64) {
        if seq <= self.high {
            return;
        }
        self.high = seq;
        if let Err(e) = self.overwrite() {
            tracing::warn!(path = %path(&self.db).display(), error = %e, "could not write the published watermark");
            self.file = None;
        }
    }

    /// Syncs what was written (the relay is stopping).
    pub(crate) fn sync(&mut self) {
        if let Some(f) = &self.file
            && let Err(e) = f.sync_data()
        {
            tracing::warn!(path = %path(&self.db).display(), error = %e, "could not sync the published watermark");
        }
    }

    fn overwrite(&mut self) -> std::io::Result<()> {
        if self.file.is_none() {
            let file = open_private(&path(&self.db), false)?;
            // Whatever was there (a torn write, garbage) must not trail the number.
            file.set_len(LEN)?;
            self.file = Some(file);
        }
        let Some(file) = self.file.as_mut() else {
            return Ok(());
        };
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&line(self.high))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watermark_only_rises_and_reads_back() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let db = dir.path().join("d.db");
        assert_eq!(read(&db), None);
        let mut w = Watermark::new(&db);
        w.raise(12_345);
        w.raise(7);
        w.sync();
        assert_eq!(read(&db), Some(12_345));
        write(&db, 3)?;
        assert_eq!(read(&db), Some(3));
        std::fs::write(path(&db), b"garbage")?;
        assert_eq!(read(&db), None);
        // Overwritten in place, over a longer file.
        std::fs::write(path(&db), b"99999999999999999999999999999")?;
        let mut w = Watermark::new(&db);
        w.raise(42);
        assert_eq!(read(&db), Some(42));
        Ok(())
    }
}
