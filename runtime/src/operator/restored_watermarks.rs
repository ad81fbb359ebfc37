//! The watermark each key group had reached before a restore.
//!
//! Windows and joins by time both keep it.
//!
//! At an aligned barrier every subtask of a window stage holds the same
//! watermark, but an unaligned barrier overtakes records and watermarks, so
//! the subtasks' snapshots may hold different ones, and the in-flight
//! records stored with the snapshot are on time only against their own
//! subtask's. A restore at another parallelism merges key groups of several
//! old subtasks into one. Taking the largest of their watermarks would make
//! replayed in-flight records of the others late (dropped: lost output);
//! taking the smallest would let a record that was late for its key group
//! reopen a window that already fired and was dropped (output twice).
//!
//! So a snapshot names the watermark of each of its key groups (metadata
//! [`KEY`], `start-end:watermark` ranges), and a restored subtask starts at
//! the smallest while it judges each record's lateness by its key group's
//! own, until its watermark passes them all. Snapshots of earlier versions
//! carry one watermark: it counts for every key group, and several are
//! combined by the largest, as those versions did.

use std::ops::RangeInclusive;

/// Schema metadata of a window's or join's snapshot: the subtask's watermark.
pub(super) const WATERMARK_KEY: &str = "weir.watermark";

/// Schema metadata of a window's or join's snapshot: each key group's watermark.
pub(super) const KEY: &str = "weir.key_group_watermarks";

/// Per key group of this subtask, the watermark restored for it; empty
/// when none is above the subtask's own (the usual case).
#[derive(Debug, Default)]
pub(super) struct RestoredWatermarks {
    first: u32,
    floors: Vec<i64>,
}

/// Parses [`KEY`]'s value; `None` when it is damaged.
pub(super) fn parse(text: &str) -> Option<Vec<(RangeInclusive<u32>, i64)>> {
    text.split(';')
        .filter(|part| !part.is_empty())
        .map(|part| {
            let (range, watermark) = part.split_once(':')?;
            let (start, end) = range.split_once('-')?;
            let (start, end) = (start.parse::<u32>().ok()?, end.parse::<u32>().ok()?);
            (start <= end).then_some(())?;
            Some((start..=end, watermark.parse::<i64>().ok()?))
        })
        .collect()
}

impl RestoredWatermarks {
    /// Takes a restored snapshot's watermarks for the key groups of
    /// `groups` (this subtask's). Overlapping entries (older snapshots,
    /// which cover every key group) combine by the largest.
    pub(super) fn add(&mut self, groups: &RangeInclusive<u32>, entries: &[(RangeInclusive<u32>, i64)]) {
        if self.floors.is_empty() {
            self.first = *groups.start();
            self.floors = vec![i64::MIN; groups.clone().count()];
        }
        for (range, watermark) in entries {
            let (start, end) = ((*range.start()).max(*groups.start()), (*range.end()).min(*groups.end()));
            // Empty when the entry lies outside `groups`.
            for g in start..=end {
                let floor = &mut self.floors[(g - self.first) as usize];
                *floor = (*floor).max(*watermark);
            }
        }
    }

    /// The watermark the subtask starts from: the smallest restored one.
    pub(super) fn lowest(&self) -> i64 {
        self.floors.iter().copied().min().unwrap_or(i64::MIN)
    }

    pub(super) fn is_active(&self) -> bool {
        !self.floors.is_empty()
    }

    /// The watermark that judges a record of key group `group`.
    pub(super) fn of(&self, group: u32, watermark: i64) -> i64 {
        let floor = group.checked_sub(self.first).and_then(|i| self.floors.get(i as usize)).copied().unwrap_or(i64::MIN);
        floor.max(watermark)
    }

    /// The subtask's watermark reached `watermark`: floors at or below it
    /// say nothing any more.
    pub(super) fn forget_below(&mut self, watermark: i64) {
        if self.floors.iter().all(|f| *f <= watermark) {
            self.floors.clear();
        }
    }

    /// [`KEY`]'s value for a snapshot of `groups` at `watermark`.
    pub(super) fn encode(&self, groups: &RangeInclusive<u32>, watermark: i64) -> String {
        let mut out: Vec<(u32, u32, i64)> = Vec::new();
        for g in groups.clone() {
            let w = self.of(g, watermark);
            match out.last_mut() {
                Some((_, end, last)) if *last == w => *end = g,
                _ => out.push((g, g, w)),
            }
        }
        out.iter().map(|(s, e, w)| format!("{s}-{e}:{w}")).collect::<Vec<_>>().join(";")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_group_keeps_the_watermark_of_the_subtask_it_came_from() {
        let mut r = RestoredWatermarks::default();
        let groups = 0..=15;
        r.add(&groups, &parse("0-7:100").unwrap());
        r.add(&groups, &parse("8-15:40").unwrap());
        assert_eq!(r.lowest(), 40);
        assert_eq!((r.of(3, 40), r.of(12, 40)), (100, 40));
        assert_eq!(r.encode(&(4..=11), 40), "4-7:100;8-11:40");
        r.forget_below(99);
        assert!(r.is_active());
        r.forget_below(100);
        assert!(!r.is_active());
        assert_eq!(r.encode(&(4..=11), 120), "4-11:120");
    }

    #[test]
    fn damaged_metadata_is_not_parsed() {
        for bad in ["x", "3-1:5", "0-1", "0-1:z", "a-b:1"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
