//! Which event-time windows a record belongs to, for the operators that
//! window: the window aggregate and the window join. Pure functions of the
//! time and the window's shape; what a window holds is the caller's.

use std::collections::BTreeSet;

/// A window as `(end, start)`: ordered by end, so that firing walks a prefix.
pub type WindowKey = (i64, i64);

/// The fixed windows holding time `t`: every `[start, start + size)` with
/// `start` a multiple of `slide` (tumbling windows: `slide = size`).
pub fn fixed_windows(t: i64, size: i64, slide: i64) -> impl Iterator<Item = WindowKey> {
    let first = t - t.rem_euclid(slide);
    (0..)
        .map(move |k: i64| first - k * slide)
        .take_while(move |start| *start > t - size)
        .map(move |start| (start + size, start))
}

/// The session of a record at `t` in a key whose sessions are `sessions`
/// (each `(start, end)`): `[t, t + gap)` merged with every session it
/// overlaps. Returns the merged `(start, end)` and the sessions it takes
/// in, whose contents the caller moves into it.
///
/// Sessions that only touch stay apart (a record at a session's end starts
/// another): whether the session at `[s, e)` still exists when a record at
/// `e` arrives depends on when the watermark reached `e − 1`, which differs
/// between a run and its replay after a failure, so merging on touch would
/// make results depend on timing. Overlap cannot: a record inside a session
/// is after the watermark, so the session has not fired.
pub fn session_of(sessions: Option<&BTreeSet<(i64, i64)>>, t: i64, gap: i64) -> ((i64, i64), Vec<(i64, i64)>) {
    let (mut start, mut end) = (t, t.saturating_add(gap));
    let overlapping: Vec<(i64, i64)> = sessions.map(|s| s.iter().filter(|(s, e)| *s < end && *e > start).copied().collect()).unwrap_or_default();
    for (s, e) in &overlapping {
        start = start.min(*s);
        end = end.max(*e);
    }
    ((start, end), overlapping)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_falls_in_size_over_slide_sliding_windows_and_in_one_tumbling_window_also_before_the_epoch() {
        assert_eq!(fixed_windows(25, 30, 10).collect::<Vec<_>>(), [(50, 20), (40, 10), (30, 0)]);
        assert_eq!(fixed_windows(-5, 10, 10).collect::<Vec<_>>(), [(0, -10)]);
        assert_eq!(fixed_windows(10, 10, 10).collect::<Vec<_>>(), [(20, 10)]);
    }

    #[test]
    fn a_session_takes_in_every_session_it_overlaps_but_not_one_it_touches() {
        let sessions = BTreeSet::from([(0, 10), (15, 20), (40, 50)]);
        assert_eq!(session_of(Some(&sessions), 9, 7), ((0, 20), vec![(0, 10), (15, 20)]));
        assert_eq!(session_of(Some(&sessions), 10, 5), ((10, 15), vec![]));
        assert_eq!(session_of(Some(&sessions), 30, 5), ((30, 35), vec![]));
        assert_eq!(session_of(None, 7, 3), ((7, 10), vec![]));
    }
}
