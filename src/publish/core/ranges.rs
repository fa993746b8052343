//! A set of numbers kept as disjoint ranges: acknowledged numbers come in long runs, so a drain
//! of any length costs a few entries.

use std::collections::BTreeMap;

#[derive(Debug, Default)]
pub(crate) struct Ranges {
    /// First number of each range to its last.
    by_first: BTreeMap<i64, i64>,
}

impl Ranges {
    pub(crate) fn insert(&mut self, n: i64) {
        let below = self.by_first.range(..=n).next_back().map(|(&f, &l)| (f, l));
        if below.is_some_and(|(_, last)| last >= n) {
            return;
        }
        let mut first = n;
        let mut last = n;
        if let Some((f, l)) = below
            && l == n - 1
        {
            first = f;
        }
        if let Some(l) = self.by_first.remove(&(n + 1)) {
            last = l;
        }
        self.by_first.insert(first, last);
    }

    pub(crate) fn clear(&mut self) {
        self.by_first.clear();
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (i64, i64)> + '_ {
        self.by_first.iter().map(|(&f, &l)| (f, l))
    }
}

/// Sorted, disjoint ranges covering `numbers` and `ranges`.
pub(crate) fn merged(numbers: impl Iterator<Item = i64>, ranges: &Ranges) -> Vec<(i64, i64)> {
    let mut all: Vec<(i64, i64)> = numbers.map(|n| (n, n)).chain(ranges.iter()).collect();
    all.sort_unstable();
    let mut out: Vec<(i64, i64)> = Vec::with_capacity(all.len());
    for (first, last) in all {
        match out.last_mut() {
            Some(prev) if first <= prev.1.saturating_add(1) => prev.1 = prev.1.max(last),
            _ => out.push((first, last)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_and_single_numbers_stay_apart() {
        let mut r = Ranges::default();
        for n in [5, 3, 4, 9, 7, 8, 1] {
            r.insert(n);
        }
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(1, 1), (3, 5), (7, 9)]);
        assert_eq!(merged([2, 12].into_iter(), &r), vec![(1, 5), (7, 9), (12, 12)]);
    }
}
