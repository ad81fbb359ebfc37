//! The deterministic generator: event i has seq = i, key = i % keys,
//! value = i. Events are dealt into `max_parallelism` splits (split k holds
//! k, k + S, k + 2S, ...), so the same events come out at every parallelism.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::SchemaRef;
use weir_api::GeneratorSpec;

use super::{Poll, SourcePositions};
use crate::error::{Error, Result};
use crate::key_group::subtask_for_group;

struct Split {
    index: u64,
    /// Events of this split already emitted.
    emitted: u64,
    /// Events in this split; `u64::MAX` for an endless generator.
    len: u64,
}

pub struct GeneratorReader {
    schema: SchemaRef,
    keys: u64,
    splits_total: u64,
    splits: Vec<Split>,
    batch_size: u64,
    /// Events per second for this subtask; 0 = unlimited.
    rate: f64,
    rate_start: Instant,
    emitted_since_start: u64,
    /// The split of the last batch.
    last: u64,
}

impl GeneratorReader {
    pub fn new(
        spec: &GeneratorSpec,
        schema: SchemaRef,
        subtask: u32,
        parallelism: u32,
        max_parallelism: u32,
        positions: &BTreeMap<String, u64>,
    ) -> Result<Self> {
        let total = max_parallelism as u64;
        let mut splits = Vec::new();
        for k in 0..total {
            if subtask_for_group(k as u32, parallelism, max_parallelism) != subtask {
                continue;
            }
            let len = match spec.events {
                Some(e) if e > k => (e - k).div_ceil(total),
                Some(_) => 0,
                None => u64::MAX,
            };
            let emitted = positions.get(&format!("generator-{k}")).copied().unwrap_or(0);
            if emitted > len {
                return Err(Error::Job(format!(
                    "checkpoint says generator split {k} is at event {emitted} but it only has {len}: was the generator's `events` lowered?"
                )));
            }
            splits.push(Split { index: k, emitted, len });
        }
        if positions.keys().any(|s| !s.starts_with("generator-")) && !positions.is_empty() {
            return Err(Error::Job("the checkpoint's source state is not a generator's: the source kind changed".into()));
        }
        // The total rate is shared in proportion to the splits each subtask owns.
        let share = splits.len() as f64 / total as f64;
        Ok(GeneratorReader {
            schema,
            keys: spec.keys.max(1),
            splits_total: total,
            splits,
            batch_size: spec.batch_size.max(1) as u64,
            rate: spec.rate as f64 * share,
            rate_start: Instant::now(),
            emitted_since_start: 0,
            last: 0,
        })
    }

    /// The next batch comes from the split furthest behind (the first of
    /// them on a tie), not from a rotation: the order then depends only on
    /// the positions, so a restored subtask goes on exactly as it would
    /// have, and its event times stay as little out of order as before the
    /// failure (a rotation restarted at split 0 could put a split two
    /// batches behind, and records that were on time late).
    pub fn poll(&mut self) -> Poll {
        let behind = self.splits.iter().enumerate().filter(|(_, s)| s.emitted < s.len).min_by_key(|(i, s)| (s.emitted, *i)).map(|(i, _)| i);
        if let Some(i) = behind {
            let remaining = self.splits[i].len - self.splits[i].emitted;
            let n = remaining.min(self.batch_size);
            if self.rate > 0.0 {
                let due = Duration::from_secs_f64((self.emitted_since_start + n) as f64 / self.rate);
                let elapsed = self.rate_start.elapsed();
                if due > elapsed {
                    return Poll::Wait(due - elapsed);
                }
            }
            let split = &mut self.splits[i];
            let (k, s) = (split.index as i64, self.splits_total as i64);
            let first = split.emitted as i64;
            let seq: Int64Array = (first..first + n as i64).map(|m| k + s * m).collect();
            let keys = self.keys as i64;
            let key: Int64Array = seq.values().iter().map(|v| v % keys).collect();
            let value = seq.clone();
            split.emitted += n;
            self.emitted_since_start += n;
            self.last = split.index;
            let batch = RecordBatch::try_new(self.schema.clone(), vec![Arc::new(seq), Arc::new(key), Arc::new(value)]);
            return match batch {
                Ok(b) => Poll::Batch(b),
                // The schema is built by the planner for exactly these three columns.
                Err(_) => Poll::Finished,
            };
        }
        Poll::Finished
    }

    pub fn last_split(&self) -> String {
        format!("generator-{}", self.last)
    }

    pub fn active_splits(&self) -> Vec<String> {
        self.splits.iter().filter(|s| s.emitted < s.len).map(|s| format!("generator-{}", s.index)).collect()
    }

    pub fn positions(&self) -> SourcePositions {
        SourcePositions {
            splits: self.splits.iter().map(|s| (format!("generator-{}", s.index), s.emitted)).collect(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::AsArray;
    use arrow::datatypes::Int64Type;
    use weir_api::pipeline::SourceSpec;

    fn spec(events: u64) -> GeneratorSpec {
        GeneratorSpec { events: Some(events), keys: 7, rate: 0, batch_size: 10 }
    }

    fn drain(r: &mut GeneratorReader, limit: usize) -> Vec<i64> {
        let mut out = Vec::new();
        for _ in 0..limit {
            match r.poll() {
                Poll::Batch(b) => out.extend(b.column(0).as_primitive::<Int64Type>().values().iter()),
                Poll::Finished => break,
                Poll::Wait(_) => panic!("no rate limit set"),
            }
        }
        out
    }

    fn schema() -> SchemaRef {
        crate::plan::source_schema(&SourceSpec::Generator(spec(0)))
    }

    #[test]
    fn all_subtasks_together_emit_every_event_once() {
        let mut all = Vec::new();
        for s in 0..3 {
            let mut r = GeneratorReader::new(&spec(1000), schema(), s, 3, 16, &BTreeMap::new()).unwrap();
            all.extend(drain(&mut r, usize::MAX));
        }
        all.sort();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn positions_restored_at_another_parallelism_continue_without_gaps_or_repeats() {
        let mut first = Vec::new();
        let mut states = Vec::new();
        for s in 0..2 {
            let mut r = GeneratorReader::new(&spec(1000), schema(), s, 2, 16, &BTreeMap::new()).unwrap();
            first.extend(drain(&mut r, 20));
            states.push(r.positions());
        }
        let merged: BTreeMap<String, u64> = states.iter().flat_map(|p| p.splits.clone()).collect();
        let mut rest = Vec::new();
        for s in 0..5 {
            let mut r = GeneratorReader::new(&spec(1000), schema(), s, 5, 16, &merged).unwrap();
            rest.extend(drain(&mut r, usize::MAX));
        }
        let mut all: Vec<i64> = first.into_iter().chain(rest).collect();
        all.sort();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn a_rate_limit_asks_the_caller_to_wait() {
        let mut s = spec(1000);
        s.rate = 10;
        let mut r = GeneratorReader::new(&s, schema(), 0, 1, 16, &BTreeMap::new()).unwrap();
        assert!(matches!(r.poll(), Poll::Wait(_)));
    }
}
