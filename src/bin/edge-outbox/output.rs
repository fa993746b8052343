//! Writing results: text for people, one JSON document for scripts; times, sizes and ages.

use std::io::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::Result;
use crate::exit::CliError;

/// Writes `text` to stdout. A reader that closed the pipe ends the command quietly.
pub fn print(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| CliError::output(&e))
}

/// Writes `value` as one pretty JSON document and a newline.
pub fn print_json(value: &serde_json::Value) -> Result<()> {
    let mut text =
        serde_json::to_string_pretty(value).map_err(|e| CliError::runtime(format!("encoding JSON: {e}")))?;
    text.push('\n');
    print(&text)
}

/// A text table: left-aligned columns, two spaces apart, the last one unpadded.
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Self {
        Table {
            rows: vec![headers.iter().map(|h| (*h).to_owned()).collect()],
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c + 1 == row.len() {
                    line.push_str(cell);
                } else {
                    let pad = widths[c].saturating_sub(cell.chars().count());
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad + 2));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Now, in Unix milliseconds (the database's clock).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Milliseconds from `then_ms` to now, zero if the clock went backwards.
pub fn age_ms(then_ms: i64) -> u64 {
    u64::try_from(now_ms().saturating_sub(then_ms)).unwrap_or(0)
}

/// Unix milliseconds as RFC 3339 UTC, e.g. `2026-05-01T12:00:00.123Z`.
pub fn timestamp(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// A duration for people: `850 ms`, `2.1 s`, `3 min 4 s`, `2 h 5 min`, `3 d 4 h`.
pub fn duration(d: Duration) -> String {
    let ms = d.as_millis();
    let s = d.as_secs();
    match s {
        _ if ms < 1000 => format!("{ms} ms"),
        0..60 => format!("{:.1} s", d.as_secs_f64()),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// A size for people: `57 B`, `1.2 KiB`, `3.4 MiB`, `1.0 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `n` followed by `word`, with an `s` unless `n` is 1.
pub fn count(n: u64, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(timestamp(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(timestamp(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(timestamp(1_777_636_800_000), "2026-05-01T12:00:00.000Z");
    }

    #[test]
    fn sizes_and_durations_read_well() {
        assert_eq!(bytes(57), "57 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(5 << 20), "5.0 MiB");
        assert_eq!(duration(Duration::from_millis(850)), "850 ms");
        assert_eq!(duration(Duration::from_millis(2100)), "2.1 s");
        assert_eq!(duration(Duration::from_secs(184)), "3 min 4 s");
        assert_eq!(duration(Duration::from_secs(3 * 86_400 + 4 * 3600)), "3 d 4 h");
    }

    #[test]
    fn tables_align_all_but_the_last_column() {
        let mut t = Table::new(&["A", "BB", "C"]);
        t.row(vec!["xxx".into(), "y".into(), "z z".into()]);
        assert_eq!(t.render(), "A    BB  C\nxxx  y   z z\n");
    }
}
