//! Hash partitioning by key group: the row goes to the subtask that owns its
//! key's group, the same rule keyed state uses, so every key's records and its
//! state meet in one subtask.

use arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use arrow::compute::take_record_batch;

use crate::error::{Error, Result};
use crate::key_group::{key_groups, subtask_for_group};

pub struct Partitioner {
    key_indices: Vec<usize>,
    parallelism: u32,
    max_parallelism: u32,
}

impl Partitioner {
    pub fn new(key_indices: Vec<usize>, parallelism: u32, max_parallelism: u32) -> Self {
        Partitioner { key_indices, parallelism, max_parallelism }
    }

    /// Splits a batch into (target subtask, rows for it), skipping empty targets.
    pub fn split(&self, batch: &RecordBatch) -> Result<Vec<(usize, RecordBatch)>> {
        if self.parallelism == 1 {
            return Ok(vec![(0, batch.clone())]);
        }
        let keys: Vec<ArrayRef> = self.key_indices.iter().map(|&i| batch.column(i).clone()).collect();
        let groups = key_groups(&keys, batch.num_rows(), self.max_parallelism)?;
        let mut indices: Vec<Vec<u32>> = vec![Vec::new(); self.parallelism as usize];
        for (row, g) in groups.into_iter().enumerate() {
            indices[subtask_for_group(g, self.parallelism, self.max_parallelism) as usize].push(row as u32);
        }
        let mut out = Vec::new();
        for (target, rows) in indices.into_iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let taken = take_record_batch(batch, &UInt32Array::from(rows)).map_err(Error::arrow("partitioning by key"))?;
            out.push((target, taken));
        }
        Ok(out)
    }
}
