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

/// Whether `first..=last` overlaps one of `sorted`, sorted disjoint ranges.
pub(crate) fn overlaps(sorted: &[(i64, i64)], first: i64, last: i64) -> bool {
    let at = sorted.partition_point(|&(_, end)| end < first);
    sorted.get(at).is_some_and(|&(start, _)| start <= last)
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
        let r = [(1, 1), (3, 5), (7, 9)];
        assert!(overlaps(&r, 5, 6) && overlaps(&r, 0, 1) && overlaps(&r, 9, 20));
        assert!(!overlaps(&r, 2, 2) && !overlaps(&r, 6, 6) && !overlaps(&r, 10, 12));
    }
}
