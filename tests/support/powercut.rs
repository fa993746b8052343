//! A FUSE file system that loses what a power cut would lose.
//!
//! Every file keeps two versions of its bytes: `current`, what reads see and writes and truncates
//! change, and `durable`, what is on "disk". `fsync`/`fdatasync` on a file copy its `current`
//! bytes (and length) to `durable`. Every directory likewise keeps two versions of its entries
//! (names to inodes): create, unlink, mkdir and rename change `current` only, and `fsync` on the
//! directory copies `current` to `durable`. [`PowerCutFs::power_cut`] throws every unsynced
//! change away: it unmounts the file system and mounts a new one made only of the durable
//! entries and bytes, as a machine rebooting after a cut would find it. Remounting also drops
//! the kernel's page, attribute and entry caches, which still hold the lost data.
//!
//! Metadata is stricter than Linux file systems, on purpose: a name becomes durable only when
//! its directory is fsynced (POSIX's rule), not as a side effect of fsyncing the file, and a
//! file's length is data (synced with its bytes). Modes, owners and times are kept in memory
//! only (SQLite does not depend on them surviving). A cut is at system call granularity: no torn
//! writes, no reordering inside an fsync, no disk that lies about flushing.
//!
//! POSIX advisory locks are left to the kernel (the file system does not implement
//! getlk/setlk, so FUSE handles `fcntl` locks locally, which is right for processes on one
//! machine). Shared `mmap` (SQLite's `-shm` wal-index) goes through the page cache: the mount
//! uses neither `direct_io` nor the writeback cache, so every `write(2)` reaches the file system
//! at once and mmap'd pages are written back by the kernel.
//!
//! Mounting needs root (or `fusermount3`, from Debian's `fuse3` package) and `/dev/fuse`; where
//! they are missing, build.rs marks the tests that mount it as ignored, with the reason.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
    WriteFlags,
};

/// Granularity of the dirty-page bookkeeping (not a limit: writes may be any size or offset).
const PAGE: usize = 4096;
/// Attribute and entry cache time. Zero: the kernel asks for every stat, so what it reports is
/// what this file system holds. (A cut remounts anyway, so this is belt and braces.)
const TTL: Duration = Duration::ZERO;

/// Counts since the first mount (they carry over cuts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// `write` requests.
    pub writes: u64,
    /// `fsync`/`fdatasync` requests on files.
    pub file_syncs: u64,
    /// `fsync` requests on directories.
    pub dir_syncs: u64,
    /// Power cuts.
    pub cuts: u64,
}

/// What was written to and synced on one file since the first mount, by its current name (the
/// flash benchmark's per-file figures).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileCount {
    /// The file's name in its directory (the last name seen, for a file that was unlinked).
    pub name: String,
    /// Bytes in `write` requests.
    pub bytes: u64,
    /// `fsync`/`fdatasync` requests.
    pub syncs: u64,
}

/// What becomes of the writes not yet synced when the power goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsynced {
    /// All lost: the disk holds exactly what was synced (LazyFS's "clear cache" fault).
    Lost,
    /// Each unsynced 4 KiB page independently reached the disk or not (from this seed), and each
    /// file's length is its synced or its current one: the kernel may write any dirty page back
    /// at any time, in any order. Pages are never torn, and directory entries still need a
    /// directory fsync.
    SomePages(u64),
}

/// Coin flips for [`Unsynced::SomePages`] (xorshift: reproducible from the seed).
struct Bits(u64);

impl Bits {
    fn next(&mut self) -> bool {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 & 1 == 1
    }
}

/// What one power cut threw away.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CutReport {
    /// Files whose current bytes differed from their durable bytes.
    pub files_rolled_back: usize,
    /// Bytes in pages written (or resized) since the file's last sync, summed over files.
    pub unsynced_bytes: u64,
    /// Directory entries created, removed or changed since their directory's last sync.
    pub entries_rolled_back: usize,
    /// With [`Unsynced::SomePages`]: unsynced pages that were kept.
    pub pages_kept: usize,
}

#[derive(Clone)]
struct Meta {
    perm: u16,
    uid: u32,
    gid: u32,
    mtime: SystemTime,
}

#[derive(Clone)]
struct FileNode {
    current: Vec<u8>,
    durable: Vec<u8>,
    /// Pages of `current` changed since the last sync (by a write or a change of length).
    dirty: BTreeSet<usize>,
    meta: Meta,
}

impl FileNode {
    fn mark(&mut self, from: usize, to: usize) {
        let last = if to > from { (to - 1) / PAGE } else { from / PAGE };
        self.dirty.extend(from / PAGE..=last);
    }

    fn set_len(&mut self, len: usize) {
        let old = self.current.len();
        if len != old {
            self.mark(old.min(len), old.max(len));
            self.current.resize(len, 0);
        }
    }

    fn len(&self) -> usize {
        self.current.len()
    }

    fn write(&mut self, offset: usize, data: &[u8]) {
        let end = offset + data.len();
        if end > self.current.len() {
            self.set_len(end);
        }
        self.current[offset..end].copy_from_slice(data);
        self.mark(offset, end);
    }

    fn sync(&mut self) {
        let len = self.current.len();
        self.durable.resize(len, 0);
        for &page in &self.dirty {
            let start = page * PAGE;
            if start >= len {
                break;
            }
            let end = (start + PAGE).min(len);
            self.durable[start..end].copy_from_slice(&self.current[start..end]);
        }
        self.dirty.clear();
    }

    /// The durable bytes plus a random subset of the unsynced pages (never a torn page), and
    /// either the durable or the current length: what the disk may hold if the kernel wrote some
    /// dirty pages back, in any order, before the cut.
    fn some_pages(&self, bits: &mut Bits, kept: &mut usize) -> Vec<u8> {
        let mut out = self.durable.clone();
        for &page in &self.dirty {
            let start = page * PAGE;
            let end = (start + PAGE).min(self.current.len());
            if start < end && bits.next() {
                if out.len() < end {
                    out.resize(end, 0);
                }
                out[start..end].copy_from_slice(&self.current[start..end]);
                *kept += 1;
            }
        }
        let len = if bits.next() {
            self.current.len()
        } else {
            self.durable.len()
        };
        out.resize(len, 0);
        out
    }

    fn unsynced(&self) -> bool {
        self.current != self.durable
    }
}

#[derive(Clone)]
struct DirNode {
    current: BTreeMap<OsString, u64>,
    durable: BTreeMap<OsString, u64>,
    meta: Meta,
}

#[derive(Clone)]
enum Node {
    File(FileNode),
    Dir(DirNode),
}

struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    counters: Counters,
    /// Bytes written and syncs per inode (they carry over cuts, as `counters` do).
    per_file: HashMap<u64, (u64, u64)>,
    /// The last name each inode had, kept after it is unlinked (for `file_counters`).
    names: HashMap<u64, String>,
    /// Set by a cut: the instance still mounted serves nothing and changes nothing any more.
    dead: bool,
    /// An injected disk failure, until cleared.
    fault: Option<Fault>,
}

/// A disk failure the file system can be told to return (see [`PowerCutFs::set_fault`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The disk is full: anything that needs a new block (a write past a file's end, a longer
    /// length, a new file) fails with `ENOSPC`; writes inside a file's length still succeed.
    NoSpace,
    /// The disk fails: every write and every sync fails with `EIO`; reads still work.
    Io,
    /// The disk is slow to flush: every file sync (`fsync`, `fdatasync`; not a directory's) takes
    /// this long, then succeeds, as on a flash chip busy with other writers' I/O. Other requests
    /// wait behind it: the file system serves one request at a time.
    SlowSync(Duration),
}

const ROOT: u64 = 1;

impl State {
    fn new() -> State {
        let root = DirNode {
            current: BTreeMap::new(),
            durable: BTreeMap::new(),
            meta: Meta {
                perm: 0o755,
                uid: 0,
                gid: 0,
                mtime: SystemTime::now(),
            },
        };
        State {
            nodes: HashMap::from([(ROOT, Node::Dir(root))]),
            next_ino: ROOT + 1,
            counters: Counters::default(),
            per_file: HashMap::new(),
            names: HashMap::new(),
            dead: false,
            fault: None,
        }
    }

    /// The state a reboot after a cut finds: durable entries and bytes only, reachable from the
    /// root. Inode numbers are kept (the next mount is a new kernel superblock anyway).
    fn after_cut(&self, unsynced: Unsynced) -> (State, CutReport) {
        let mut report = CutReport::default();
        let mut bits = match unsynced {
            Unsynced::Lost => None,
            Unsynced::SomePages(seed) => Some(Bits(seed | 1)),
        };
        let mut nodes = HashMap::new();
        let mut todo = vec![ROOT];
        while let Some(ino) = todo.pop() {
            if nodes.contains_key(&ino) {
                continue;
            }
            let Some(node) = self.nodes.get(&ino) else {
                continue;
            };
            let survivor = match node {
                Node::Dir(d) => {
                    let changed = d
                        .current
                        .iter()
                        .filter(|(name, ino)| d.durable.get(*name) != Some(ino))
                        .count()
                        + d.durable
                            .keys()
                            .filter(|name| !d.current.contains_key(*name))
                            .count();
                    report.entries_rolled_back += changed;
                    todo.extend(d.durable.values().copied());
                    Node::Dir(DirNode {
                        current: d.durable.clone(),
                        durable: d.durable.clone(),
                        meta: d.meta.clone(),
                    })
                }
                Node::File(f) => {
                    if f.unsynced() {
                        report.files_rolled_back += 1;
                    }
                    let durable = match &mut bits {
                        None => f.durable.clone(),
                        Some(bits) => f.some_pages(bits, &mut report.pages_kept),
                    };
                    Node::File(FileNode {
                        current: durable.clone(),
                        durable,
                        dirty: BTreeSet::new(),
                        meta: f.meta.clone(),
                    })
                }
            };
            nodes.insert(ino, survivor);
        }
        // Unsynced bytes of every file, reachable or not (an unsynced new file is all unsynced).
        for node in self.nodes.values() {
            if let Node::File(f) = node {
                report.unsynced_bytes += f
                    .dirty
                    .iter()
                    .map(|&p| (f.current.len().saturating_sub(p * PAGE)).min(PAGE) as u64)
                    .sum::<u64>();
            }
        }
        let mut counters = self.counters;
        counters.cuts += 1;
        let state = State {
            nodes,
            next_ino: self.next_ino,
            counters,
            per_file: self.per_file.clone(),
            names: self.names.clone(),
            dead: false,
            fault: None,
        };
        (state, report)
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let node = self.nodes.get(&ino)?;
        let (kind, size, meta, nlink) = match node {
            Node::File(f) => (
                FileType::RegularFile,
                f.current.len() as u64,
                &f.meta,
                self.links(ino),
            ),
            Node::Dir(d) => (FileType::Directory, 0, &d.meta, 2),
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: meta.mtime,
            mtime: meta.mtime,
            ctime: meta.mtime,
            crtime: meta.mtime,
            kind,
            perm: meta.perm,
            nlink,
            uid: meta.uid,
            gid: meta.gid,
            rdev: 0,
            blksize: PAGE as u32,
            flags: 0,
        })
    }

    /// How many current directory entries name `ino` (SQLite checks a database's link count to
    /// notice that it was deleted while open).
    fn links(&self, ino: u64) -> u32 {
        self.nodes
            .values()
            .filter_map(|n| match n {
                Node::Dir(d) => Some(d.current.values().filter(|&&i| i == ino).count() as u32),
                Node::File(_) => None,
            })
            .sum()
    }

    fn dir(&mut self, ino: u64) -> Result<&mut DirNode, Errno> {
        match self.nodes.get_mut(&ino) {
            Some(Node::Dir(d)) => Ok(d),
            Some(Node::File(_)) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn file(&mut self, ino: u64) -> Result<&mut FileNode, Errno> {
        match self.nodes.get_mut(&ino) {
            Some(Node::File(f)) => Ok(f),
            Some(Node::Dir(_)) => Err(Errno::EISDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn add(&mut self, parent: u64, name: &OsStr, node: Node) -> Result<FileAttr, Errno> {
        let ino = self.next_ino;
        let dir = self.dir(parent)?;
        if dir.current.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        dir.current.insert(name.to_owned(), ino);
        dir.meta.mtime = SystemTime::now();
        self.names.insert(ino, name.to_string_lossy().into_owned());
        self.next_ino += 1;
        self.nodes.insert(ino, node);
        self.attr(ino).ok_or(Errno::EIO)
    }
}

/// The FUSE side: requests come in on the session thread and work on the shared state.
struct Fs {
    state: Arc<Mutex<State>>,
}

impl Fs {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the live state; after a cut, fails with EIO and changes nothing.
    fn with<T>(&self, f: impl FnOnce(&mut State) -> Result<T, Errno>) -> Result<T, Errno> {
        let mut state = self.lock();
        if state.dead {
            return Err(Errno::EIO);
        }
        f(&mut state)
    }
}

fn meta_for(req: &Request, mode: u32, umask: u32) -> Meta {
    Meta {
        perm: (mode & !umask & 0o7777) as u16,
        uid: req.uid(),
        gid: req.gid(),
        mtime: SystemTime::now(),
    }
}

fn time_of(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl Filesystem for Fs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.with(|s| {
            let ino = *s.dir(parent.0)?.current.get(name).ok_or(Errno::ENOENT)?;
            s.attr(ino).ok_or(Errno::ENOENT)
        }) {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.with(|s| s.attr(ino.0).ok_or(Errno::ENOENT)) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let result = self.with(|s| {
            let fault = s.fault;
            let meta = match s.nodes.get_mut(&ino.0).ok_or(Errno::ENOENT)? {
                Node::File(f) => {
                    if let Some(size) = size {
                        let size = usize::try_from(size).map_err(|_| Errno::EFBIG)?;
                        match fault {
                            Some(Fault::Io) => return Err(Errno::EIO),
                            Some(Fault::NoSpace) if size > f.len() => return Err(Errno::ENOSPC),
                            _ => {}
                        }
                        f.set_len(size);
                        f.meta.mtime = SystemTime::now();
                    }
                    &mut f.meta
                }
                Node::Dir(d) => {
                    if size.is_some() {
                        return Err(Errno::EISDIR);
                    }
                    &mut d.meta
                }
            };
            if let Some(mode) = mode {
                meta.perm = (mode & 0o7777) as u16;
            }
            if let Some(uid) = uid {
                meta.uid = uid;
            }
            if let Some(gid) = gid {
                meta.gid = gid;
            }
            if let Some(t) = mtime {
                meta.mtime = time_of(t);
            }
            s.attr(ino.0).ok_or(Errno::ENOENT)
        });
        match result {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(Errno::EPERM);
        }
        let node = Node::File(FileNode {
            current: Vec::new(),
            durable: Vec::new(),
            dirty: BTreeSet::new(),
            meta: meta_for(req, mode, umask),
        });
        match self.with(|s| s.add(parent.0, name, node)) {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let node = Node::Dir(DirNode {
            current: BTreeMap::new(),
            durable: BTreeMap::new(),
            meta: meta_for(req, mode, umask),
        });
        match self.with(|s| s.add(parent.0, name, node)) {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        // The inode stays: an open descriptor may still read, write and fsync it, and the durable
        // entry (if the unlink is never synced) still names it.
        match self.with(|s| {
            let ino = *s.dir(parent.0)?.current.get(name).ok_or(Errno::ENOENT)?;
            if matches!(s.nodes.get(&ino), Some(Node::Dir(_))) {
                return Err(Errno::EISDIR);
            }
            let dir = s.dir(parent.0)?;
            dir.current.remove(name);
            dir.meta.mtime = SystemTime::now();
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.with(|s| {
            let ino = *s.dir(parent.0)?.current.get(name).ok_or(Errno::ENOENT)?;
            if !s.dir(ino)?.current.is_empty() {
                return Err(Errno::ENOTEMPTY);
            }
            s.dir(parent.0)?.current.remove(name);
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if !flags.is_empty() {
            return reply.error(Errno::EINVAL);
        }
        match self.with(|s| {
            let ino = *s.dir(parent.0)?.current.get(name).ok_or(Errno::ENOENT)?;
            if let Some(&old) = s.dir(newparent.0)?.current.get(newname)
                && matches!(s.nodes.get(&old), Some(Node::Dir(_)))
            {
                return Err(Errno::EISDIR);
            }
            s.dir(parent.0)?.current.remove(name);
            s.dir(newparent.0)?.current.insert(newname.to_owned(), ino);
            s.names.insert(ino, newname.to_string_lossy().into_owned());
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // No FOPEN_KEEP_CACHE: each open drops the kernel's cached pages of the file.
        match self.with(|s| s.attr(ino.0).map(|_| ()).ok_or(Errno::ENOENT)) {
            Ok(()) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let node = Node::File(FileNode {
            current: Vec::new(),
            durable: Vec::new(),
            dirty: BTreeSet::new(),
            meta: meta_for(req, mode, umask),
        });
        let result = self.with(|s| match s.fault {
            Some(Fault::NoSpace) => Err(Errno::ENOSPC),
            Some(Fault::Io) => Err(Errno::EIO),
            None | Some(Fault::SlowSync(_)) => s.add(parent.0, name, node),
        });
        match result {
            Ok(attr) => reply.created(&TTL, &attr, Generation(0), FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let result = self.with(|s| {
            let f = s.file(ino.0)?;
            let start = usize::try_from(offset).unwrap_or(usize::MAX).min(f.current.len());
            let end = start.saturating_add(size as usize).min(f.current.len());
            Ok(f.current[start..end].to_vec())
        });
        match result {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let result = self.with(|s| {
            s.counters.writes += 1;
            s.per_file.entry(ino.0).or_default().0 += data.len() as u64;
            let fault = s.fault;
            let f = s.file(ino.0)?;
            let offset = usize::try_from(offset).map_err(|_| Errno::EFBIG)?;
            match fault {
                Some(Fault::Io) => return Err(Errno::EIO),
                Some(Fault::NoSpace) if offset.saturating_add(data.len()) > f.len() => {
                    return Err(Errno::ENOSPC);
                }
                _ => {}
            }
            f.write(offset, data);
            f.meta.mtime = SystemTime::now();
            Ok(data.len() as u32)
        });
        match result {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) is not a sync.
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        // fsync and fdatasync alike: the bytes and the length, not the name (see the module docs).
        let fault = self.lock().fault;
        if let Some(Fault::SlowSync(wait)) = fault {
            std::thread::sleep(wait);
        }
        match self.with(|s| {
            s.counters.file_syncs += 1;
            s.per_file.entry(ino.0).or_default().1 += 1;
            if s.fault == Some(Fault::Io) {
                return Err(Errno::EIO);
            }
            s.file(ino.0)?.sync();
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let result = self.with(|s| {
            let entries: Vec<(OsString, u64)> = s
                .dir(ino.0)?
                .current
                .iter()
                .map(|(n, i)| (n.clone(), *i))
                .collect();
            let mut all = vec![(OsString::from("."), ino.0, FileType::Directory)];
            all.push((OsString::from(".."), ROOT, FileType::Directory));
            for (name, i) in entries {
                let kind = match s.nodes.get(&i) {
                    Some(Node::Dir(_)) => FileType::Directory,
                    _ => FileType::RegularFile,
                };
                all.push((name, i, kind));
            }
            Ok(all)
        });
        match result {
            Ok(all) => {
                for (i, (name, ino, kind)) in all.into_iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(ino), (i + 1) as u64, kind, &name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.with(|s| {
            s.counters.dir_syncs += 1;
            let d = s.dir(ino.0)?;
            d.durable = d.current.clone();
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(
            1 << 20,
            1 << 19,
            1 << 19,
            1 << 16,
            1 << 15,
            PAGE as u32,
            255,
            PAGE as u32,
        );
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }
}

/// A mounted power-cut file system in a temp dir. Unmounted (and its thread joined) on drop.
pub struct PowerCutFs {
    _dir: tempfile::TempDir,
    mountpoint: PathBuf,
    state: Arc<Mutex<State>>,
    session: Option<BackgroundSession>,
}

impl PowerCutFs {
    /// Mounts an empty file system in a new temp dir.
    pub fn mount() -> io::Result<PowerCutFs> {
        let dir = tempfile::Builder::new()
            .prefix("edge-outbox-powercut")
            .tempdir()?;
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&mountpoint)?;
        let state = Arc::new(Mutex::new(State::new()));
        let session = start(&mountpoint, state.clone())?;
        Ok(PowerCutFs {
            _dir: dir,
            mountpoint,
            state,
            session: Some(session),
        })
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// From now on, fail as `fault` says (`None`: work again). Survives no cut: a cut brings the
    /// disk back healthy.
    pub fn set_fault(&self, fault: Option<Fault>) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).fault = fault;
    }

    /// Counts of writes, syncs and cuts so far.
    pub fn counters(&self) -> Counters {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).counters
    }

    /// Bytes written and syncs per file since the first mount, by name (files never written
    /// nor synced are left out).
    pub fn file_counters(&self) -> Vec<FileCount> {
        let s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<FileCount> = s
            .per_file
            .iter()
            .map(|(ino, &(bytes, syncs))| FileCount {
                name: s
                    .names
                    .get(ino)
                    .cloned()
                    .unwrap_or_else(|| format!("(inode {ino})")),
                bytes,
                syncs,
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Cuts the power: every change not made durable by an fsync is lost, and the file system
    /// comes back (at the same path) with the durable state only. Stop every process using the
    /// file system first (a killed process is fine: kill it and wait for it); a file still open
    /// makes the unmount fail with `EBUSY`.
    pub fn power_cut(&mut self) -> io::Result<CutReport> {
        self.power_cut_with(Unsynced::Lost)
    }

    /// [`power_cut`](Self::power_cut), choosing what becomes of unsynced writes.
    pub fn power_cut_with(&mut self, unsynced: Unsynced) -> io::Result<CutReport> {
        let (survivor, report) = {
            let mut old = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let cut = old.after_cut(unsynced);
            // From here the old mount answers EIO and changes nothing: a late request (a dead
            // process's last write-back) cannot reach the new state.
            old.dead = true;
            cut
        };
        if let Some(session) = self.session.take() {
            unmount(&self.mountpoint, session)?;
        }
        self.state = Arc::new(Mutex::new(survivor));
        self.session = Some(start(&self.mountpoint, self.state.clone())?);
        Ok(report)
    }
}

fn start(mountpoint: &Path, state: Arc<Mutex<State>>) -> io::Result<BackgroundSession> {
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("edge-outbox-powercut".into()),
        MountOption::Subtype("powercut".into()),
        MountOption::NoExec,
        MountOption::NoDev,
        MountOption::NoSuid,
    ];
    fuser::spawn_mount(Fs { state }, mountpoint, &config)
}

/// Unmounts and joins the session thread. A process that has just been forked (by any test
/// thread of this process) holds copies of our descriptors until it execs, which makes the mount
/// busy for a moment: retry `EBUSY` for a while, then detach lazily and give up on the thread.
/// The one `unsafe` of the project, in a test helper: `umount2` has no safe wrapper in `libc`.
#[allow(unsafe_code)]
fn unmount(mountpoint: &Path, session: BackgroundSession) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        // SAFETY: `path` is a valid NUL-terminated string that outlives the call.
        if unsafe { libc::umount2(path.as_ptr(), 0) } == 0 {
            // The kernel ended the connection: the session thread stops. (Not umount_and_join:
            // fuser would try to unmount again and fail with EINVAL.)
            return session.join();
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            // Not root: fuser unmounts through fusermount3.
            Some(libc::EPERM) => return session.umount_and_join(),
            Some(libc::EBUSY) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Some(libc::EBUSY) => {
                // SAFETY: as above.
                unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
                std::mem::forget(session);
                return Err(io::Error::new(
                    err.kind(),
                    format!(
                        "{} still busy after 10 s; detached it: {err}",
                        mountpoint.display()
                    ),
                ));
            }
            _ => return Err(err),
        }
    }
}

impl Drop for PowerCutFs {
    fn drop(&mut self) {
        if let Some(session) = self.session.take()
            && let Err(e) = unmount(&self.mountpoint, session)
        {
            eprintln!(
                "power-cut file system at {}: unmount failed: {e}",
                self.mountpoint.display()
            );
        }
    }
}

impl std::fmt::Debug for PowerCutFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PowerCutFs")
            .field("mountpoint", &self.mountpoint)
            .field("counters", &self.counters())
            .finish_non_exhaustive()
    }
}
