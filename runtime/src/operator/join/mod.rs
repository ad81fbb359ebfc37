//! Operators that read two inputs: joins. Each keeps the rows of both
//! sides per key in key groups (`side.rs`), in checkpoints under
//! `<id>.left` and `<id>.right`, so that they rescale like every keyed state.
//!
//! A join is the first operator of its stage and the only one that sees
//! which input a batch came from; the stage's gate aligns barriers and
//! combines watermarks over both inputs.

mod interval;
mod lookup;
mod regular;
mod side;
mod window;

pub use interval::IntervalJoin;
pub use lookup::LookupJoin;
pub use regular::{wall_clock, RegularJoin};
#[cfg(test)]
use regular::Clock;
pub use window::WindowJoin;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod regular_tests;
#[cfg(test)]
mod window_tests;
