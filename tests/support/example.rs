//! The examples as child processes: `examples/cloud_consumer.rs`, the consumer a new user copies,
//! started, read line by line, killed and restarted.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::ChildGuard;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The example's binary, which `cargo test` builds beside the test binaries; an error if it is
/// missing or older than its source or the library's (a stale binary would test old code).
pub fn path(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let debug = exe
        .parent()
        .and_then(|deps| deps.parent())
        .ok_or("no target dir")?;
    let path = debug.join("examples").join(name);
    let built = std::fs::metadata(&path).and_then(|m| m.modified()).map_err(|e| {
        format!(
            "{} was not built ({e}): `cargo test` builds it, `cargo test --test` does not",
            path.display()
        )
    })?;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let source = std::fs::metadata(root.join("examples").join(format!("{name}.rs")))?.modified()?;
    if source.max(newest(&root.join("src"))?) > built {
        return Err(format!(
            "{} is older than its source: run `cargo build --examples --all-features`",
            path.display()
        )
        .into());
    }
    Ok(path)
}

/// The newest modification time of the files under `dir`: the library the example links.
fn newest(dir: &std::path::Path) -> std::io::Result<std::time::SystemTime> {
    let mut latest = std::time::SystemTime::UNIX_EPOCH;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        let time = if meta.is_dir() {
            newest(&entry.path())?
        } else {
            meta.modified()?
        };
        latest = latest.max(time);
    }
    Ok(latest)
}

/// `examples/cloud_consumer.rs` running, its stdout collected line by line.
pub struct CloudConsumer {
    child: ChildGuard,
    lines: mpsc::Receiver<String>,
    /// Every line read so far.
    pub said: Vec<String>,
}

impl CloudConsumer {
    /// Starts the example with `args` and waits until it has subscribed.
    pub fn start(args: &[&str]) -> Result<CloudConsumer> {
        let mut consumer = Self::spawn(args)?;
        consumer.wait_for("subscribed to ", super::WAIT)?;
        Ok(consumer)
    }

    /// One shard's consumer: `fleet/<shard>/#` on `brokers` (`HOST:PORT[,...]`), client id
    /// `cloud-<shard>`, counting from the start, exiting after `idle_secs` without a message.
    pub fn start_shard(brokers: &str, db: &Path, shard: &str, idle_secs: u32) -> Result<CloudConsumer> {
        Self::start(&[
            brokers,
            db.to_str().ok_or("path")?,
            &format!("fleet/{shard}/#"),
            "--client-id",
            &format!("cloud-{shard}"),
            "--from-start",
            "--exit-when-idle",
            &idle_secs.to_string(),
            "--report-every",
            "3600",
        ])
    }

    /// Starts the example with `args`, without waiting (its broker may be down).
    pub fn spawn(args: &[&str]) -> Result<CloudConsumer> {
        let mut child = ChildGuard::new(
            Command::new(path("cloud_consumer")?)
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?,
        );
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let stderr = child.stderr.take().ok_or("no stderr")?;
        let (tx, lines) = mpsc::channel();
        let err_tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(std::result::Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // Its errors too, marked, in the same list (and on this test's stderr).
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(std::result::Result::ok) {
                eprintln!("cloud_consumer: {line}");
                if err_tx.send(format!("stderr: {line}")).is_err() {
                    break;
                }
            }
        });
        Ok(CloudConsumer {
            child,
            lines,
            said: Vec::new(),
        })
    }

    /// Waits for a line starting with `prefix`.
    pub fn wait_for(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let line = self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .map_err(|_| match stopped_on_a_repeat(&self.said) {
                    Some(why) => why,
                    None => format!("no line starting with {prefix:?}: {:#?}", self.said),
                })?;
            self.said.push(line.clone());
            if line.starts_with(prefix) {
                return Ok(line);
            }
        }
    }

    /// SIGKILL, now: a crash at whatever point it had reached.
    pub fn kill(mut self) {
        self.child.kill_and_wait();
    }

    /// Waits for it to exit on its own (`--exit-when-idle`); its status and everything it said.
    pub fn wait(mut self, timeout: Duration) -> Result<(ExitStatus, Vec<String>)> {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() >= deadline {
                return Err(format!("the consumer did not exit: {:#?}", self.said).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // The reader ends at the pipe's end.
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.said.push(line);
        }
        Ok((status, self.said))
    }
}

/// Rows the example's effect stored in `db`, per source: (how many, the highest number).
pub fn shard_rows(db: &Path) -> Result<BTreeMap<String, (u64, u64)>> {
    let conn = rusqlite::Connection::open(db)?;
    let mut stmt = conn.prepare("SELECT source, count(*), max(seq) FROM events GROUP BY source")?;
    let rows = stmt.query_map([], |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
    })?;
    let mut out = BTreeMap::new();
    for row in rows {
        let (source, n, high) = row?;
        out.insert(source, (u64::try_from(n)?, u64::try_from(high)?));
    }
    Ok(out)
}

/// What the tests say when the consumer called a message it had stored new again.
pub const TAKEN_TWICE: &str = "a message taken for new twice";

/// Why the consumer stopped, if it stopped because it called a message it had stored new again:
/// the example's effect refuses a second row for a message (a unique key), and the example stops.
fn stopped_on_a_repeat(said: &[String]) -> Option<String> {
    said.iter()
        .any(|l| l.contains("UNIQUE constraint failed: events.message_id"))
        .then(|| {
            format!(
                "{TAKEN_TWICE}: the consumer's effect refused a second row for it and the consumer stopped: {said:#?}"
            )
        })
}

/// The totals of a consumer that ran to its end, as [`totals`]; an error saying why not.
pub fn final_totals(said: &[String]) -> Result<(u64, u64, u64, u64)> {
    if let Some(why) = stopped_on_a_repeat(said) {
        return Err(why.into());
    }
    totals(said)
}

/// The example's `totals:` line, as (delivered, duplicates, announced, unexplained).
pub fn totals(said: &[String]) -> Result<(u64, u64, u64, u64)> {
    let line = said
        .iter()
        .find(|l| l.starts_with("totals:"))
        .ok_or_else(|| format!("no totals: {said:#?}"))?;
    let n: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()?;
    match n[..] {
        [delivered, duplicates, announced, unexplained] => {
            Ok((delivered, duplicates, announced, unexplained))
        }
        _ => Err(format!("unexpected totals line {line:?}").into()),
    }
}
