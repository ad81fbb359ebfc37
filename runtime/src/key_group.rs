//! Key groups: the unit in which keyed state is partitioned, stored and
//! redistributed.
//!
//! A key's group is a stable hash of its value modulo `max_parallelism`; a
//! subtask owns a contiguous range of groups. Because the hash depends only on
//! the key's value (never on the process, the platform or the parallelism), a
//! checkpoint taken at one parallelism can be restored at another: each new
//! subtask reads the groups of its range from whichever old files hold them.
//! The hash is part of the checkpoint format: changing it breaks restores.
//!
//! Float keys are hashed by value, not by bit pattern: -0.0 is hashed as 0.0
//! and every NaN as one NaN, since they compare (or are meant) equal as keys.
//! This changed the groups of exactly those keys; every other value hashes as
//! before, so checkpoints written before keep their layout (a restore
//! recomputes the groups of float keys instead of trusting the stored ones).

use std::ops::RangeInclusive;

use arrow::array::{Array, ArrayRef, AsArray};
use arrow::datatypes::{DataType, Float64Type, Int64Type};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::{Error, Result};

/// The subtask (of `parallelism`) that owns key group `group`.
pub fn subtask_for_group(group: u32, parallelism: u32, max_parallelism: u32) -> u32 {
    ((group as u64 * parallelism as u64) / max_parallelism as u64) as u32
}

/// The key groups owned by `subtask`: the inverse of [`subtask_for_group`].
pub fn groups_of_subtask(subtask: u32, parallelism: u32, max_parallelism: u32) -> RangeInclusive<u32> {
    let (s, p, m) = (subtask as u64, parallelism as u64, max_parallelism as u64);
    let start = (s * m).div_ceil(p);
    let end = ((s + 1) * m - 1) / p;
    start as u32..=end as u32
}

/// The one value a float key stands for: -0.0 is 0.0, and all NaNs (any
/// sign, any payload) are one NaN. Hashing and keyed state both use it, so
/// that `-0.0` and `0.0` are the same key everywhere.
pub fn canonical_f64(v: f64) -> f64 {
    if v == 0.0 {
        0.0
    } else if v.is_nan() {
        f64::NAN
    } else {
        v
    }
}

/// Stable 64-bit hashes of the keys of every row, folding several key columns.
pub fn hash_keys(columns: &[ArrayRef], rows: usize) -> Result<Vec<u64>> {
    let mut hashes = vec![0u64; rows];
    for (c, col) in columns.iter().enumerate() {
        let seed = c as u64;
        let first = c == 0;
        let mut fold = |i: usize, bytes: &[u8]| {
            let h = xxh3_64_with_seed(bytes, seed);
            hashes[i] = if first { h } else { hashes[i].rotate_left(5) ^ h };
        };
        match col.data_type() {
            DataType::Int64 => {
                let a = col.as_primitive::<Int64Type>();
                for i in 0..rows {
                    if a.is_null(i) {
                        fold(i, &[0xff]);
                    } else {
                        fold(i, &a.value(i).to_le_bytes());
                    }
                }
            }
            DataType::Float64 => {
                let a = col.as_primitive::<Float64Type>();
                for i in 0..rows {
                    if a.is_null(i) {
                        fold(i, &[0xff]);
                    } else {
                        fold(i, &canonical_f64(a.value(i)).to_bits().to_le_bytes());
                    }
                }
            }
            DataType::Utf8 => {
                let a = col.as_string::<i32>();
                for i in 0..rows {
                    if a.is_null(i) {
                        fold(i, &[0xff]);
                    } else {
                        fold(i, a.value(i).as_bytes());
                    }
                }
            }
            DataType::Boolean => {
                let a = col.as_boolean();
                for i in 0..rows {
                    if a.is_null(i) {
                        fold(i, &[0xff]);
                    } else {
                        fold(i, &[a.value(i) as u8]);
                    }
                }
            }
            other => {
                return Err(Error::Plan {
                    context: "key_by".into(),
                    message: format!("cannot key by a field of type {other}: expected int64, float64, string or boolean"),
                })
            }
        }
    }
    Ok(hashes)
}

/// The key group of each row.
pub fn key_groups(columns: &[ArrayRef], rows: usize, max_parallelism: u32) -> Result<Vec<u32>> {
    Ok(hash_keys(columns, rows)?
        .into_iter()
        .map(|h| (h % max_parallelism as u64) as u32)
        .collect())
}

/// Whether key columns of this type can be hashed into key groups.
pub fn is_key_type(t: &DataType) -> bool {
    matches!(t, DataType::Int64 | DataType::Float64 | DataType::Utf8 | DataType::Boolean)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int64Array, StringArray};
    use std::sync::Arc;

    #[test]
    fn every_group_has_exactly_one_owner_at_every_parallelism() {
        for max in [1u32, 7, 128, 1000] {
            for p in 1..=max.min(40) {
                let mut owned = vec![0u32; max as usize];
                for s in 0..p {
                    for g in groups_of_subtask(s, p, max) {
                        owned[g as usize] += 1;
                        assert_eq!(subtask_for_group(g, p, max), s, "max {max} p {p} g {g}");
                    }
                }
                assert!(owned.iter().all(|&n| n == 1), "max {max} p {p}");
            }
        }
    }

    #[test]
    fn key_groups_are_stable_values_not_process_dependent() {
        // These numbers are part of the checkpoint format: if this test
        // changes, old checkpoints restore keys into the wrong subtasks.
        let keys: ArrayRef = Arc::new(Int64Array::from(vec![0, 1, 42]));
        assert_eq!(key_groups(&[keys], 3, 128).unwrap(), vec![
            (xxh3_64_with_seed(&0i64.to_le_bytes(), 0) % 128) as u32,
            (xxh3_64_with_seed(&1i64.to_le_bytes(), 0) % 128) as u32,
            (xxh3_64_with_seed(&42i64.to_le_bytes(), 0) % 128) as u32,
        ]);
    }

    #[test]
    fn string_keys_spread_over_groups() {
        let keys: Vec<String> = (0..1000).map(|i| format!("user-{i}")).collect();
        let col: ArrayRef = Arc::new(StringArray::from(keys));
        let groups = key_groups(&[col], 1000, 16).unwrap();
        let mut counts = [0; 16];
        for g in groups {
            counts[g as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c > 30), "{counts:?}");
    }

    #[test]
    fn negative_zero_and_every_nan_hash_like_their_canonical_value() {
        let weird_nan = f64::from_bits(0xfff8_0000_0000_0001);
        let keys: ArrayRef = Arc::new(Float64Array::from(vec![0.0, -0.0, f64::NAN, -f64::NAN, weird_nan, 1.5]));
        let h = hash_keys(&[keys], 6).unwrap();
        assert_eq!(h[0], h[1], "-0.0 and 0.0");
        assert_eq!((h[2], h[2]), (h[3], h[4]), "NaNs");
        assert_ne!(h[0], h[2]);
        // Other values hash exactly as before: their bit pattern.
        assert_eq!(h[5], xxh3_64_with_seed(&1.5f64.to_bits().to_le_bytes(), 0));
        assert_eq!(h[0], xxh3_64_with_seed(&0.0f64.to_bits().to_le_bytes(), 0));
    }
}
