//! Damage to a database file, page by page, for the salvage tests: rows whose payload carries a
//! mark that can be found in the file's bytes, and a page holding one overwritten with garbage.

use std::collections::BTreeSet;
use std::path::Path;

const MARK: &[u8] = b"row-";

/// A payload for row `n`, long enough that a page holds a few dozen rows, carrying its mark.
pub fn marked_payload(n: i64) -> String {
    format!("row-{n:06}-{}", "x".repeat(90))
}

/// The row numbers whose mark appears in `page`.
pub fn marks_in(page: &[u8]) -> BTreeSet<i64> {
    let mut found = BTreeSet::new();
    for at in 0..=page.len().saturating_sub(MARK.len() + 6) {
        if &page[at..at + MARK.len()] == MARK
            && let Ok(digits) = std::str::from_utf8(&page[at + 4..at + 10])
            && let Ok(n) = digits.parse::<i64>()
        {
            found.insert(n);
        }
    }
    found
}

/// Overwrites the first page of `db` holding the mark of row `near` with garbage; returns the
/// rows that page held.
pub fn damage_page_of(
    db: &Path,
    page_size: usize,
    near: i64,
) -> Result<BTreeSet<i64>, Box<dyn std::error::Error>> {
    let mut bytes = std::fs::read(db)?;
    let needle = format!("row-{near:06}");
    let page = bytes
        .chunks(page_size)
        .position(|p| p.windows(needle.len()).any(|w| w == needle.as_bytes()))
        .ok_or_else(|| format!("no page holds {needle}"))?;
    let range = page * page_size..(page + 1) * page_size;
    let rows = marks_in(&bytes[range.clone()]);
    bytes[range].fill(0xAB);
    std::fs::write(db, bytes)?;
    Ok(rows)
}
