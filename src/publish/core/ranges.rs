//! Numbers as sorted, disjoint ranges: acknowledged and in-flight numbers come in runs, so the
//! set a read carries stays short.

/// Sorted, disjoint ranges covering `numbers`.
pub(crate) fn merged(numbers: impl Iterator<Item = i64>) -> Vec<(i64, i64)> {
    let mut all: Vec<i64> = numbers.collect();
    all.sort_unstable();
    let mut out: Vec<(i64, i64)> = Vec::new();
    for n in all {
        match out.last_mut() {
            Some(prev) if n <= prev.1.saturating_add(1) => prev.1 = prev.1.max(n),
            _ => out.push((n, n)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_and_single_numbers_stay_apart() {
        assert_eq!(
            merged([5, 3, 4, 9, 7, 8, 1, 4].into_iter()),
            vec![(1, 1), (3, 5), (7, 9)]
        );
    }
}
