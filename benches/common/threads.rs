//! Per-thread CPU time and wake-ups of this process, from `/proc/self/task` (Linux).
//!
//! `#[path = "common/threads.rs"] mod threads;` from the benchmarks that count them.

#![allow(dead_code, reason = "each benchmark uses a part")]

/// CPU seconds and context switches (voluntary + involuntary) of threads, summed.
#[derive(Clone, Copy, Default, Debug)]
pub struct Usage {
    pub cpu_secs: f64,
    pub switches: u64,
}

impl Usage {
    pub fn since(self, earlier: Usage) -> Usage {
        Usage {
            cpu_secs: self.cpu_secs - earlier.cpu_secs,
            switches: self.switches.saturating_sub(earlier.switches),
        }
    }
}

/// The live threads of this process whose name (as the kernel keeps it, truncated to 15 bytes)
/// starts with one of `prefixes`.
pub fn usage(prefixes: &[&str]) -> Usage {
    usage_by_name(prefixes)
        .into_iter()
        .fold(Usage::default(), |total, (_, u)| Usage {
            cpu_secs: total.cpu_secs + u.cpu_secs,
            switches: total.switches + u.switches,
        })
}

/// User + system CPU seconds of a whole process (every thread, exited ones included), from
/// `/proc/<pid>/stat` (clock ticks of 10 ms).
pub fn process_cpu_secs(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces), starting at field 3.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The relay's threads (publisher, connection, marker and any helper): all named so.
pub const RELAY: &[&str] = &["edge-outbox"];

/// Like [`usage`], one entry per thread name (threads of one name summed), sorted by name.
pub fn usage_by_name(prefixes: &[&str]) -> Vec<(String, Usage)> {
    let mut out: Vec<(String, Usage)> = Vec::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let name = comm.trim_end().to_owned();
        if !prefixes.iter().any(|p| name.starts_with(&p[..p.len().min(15)])) {
            continue;
        }
        let Some(id) = task.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let u = task_usage(&id);
        match out.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => {
                total.cpu_secs += u.cpu_secs;
                total.switches += u.switches;
            }
            None => out.push((name, u)),
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn task_usage(tid: &str) -> Usage {
    let dir = std::path::Path::new("/proc/self/task").join(tid);
    let mut u = Usage {
        cpu_secs: std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
            .unwrap_or(0) as f64
            / 1e9,
        switches: 0,
    };
    let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
    for line in status.lines() {
        if let Some(v) = line
            .strip_prefix("voluntary_ctxt_switches:")
            .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
        {
            u.switches += v.trim().parse::<u64>().unwrap_or(0);
        }
    }
    u
}
