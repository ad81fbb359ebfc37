//! Operators chained inside a stage: filter, select and keyed running
//! aggregates. An operator turns one record batch into at most one record
//! batch; the stateful ones also snapshot and restore their state by key group.
//!
//! Operators do not know about barriers, channels or storage: the subtask
//! loop calls `snapshot` at the aligned barrier and writes what it returns.

mod running;

use std::sync::Arc;

use arrow::array::{AsArray, RecordBatch};
use arrow::compute::filter_record_batch;
use arrow::datatypes::SchemaRef;
use datafusion_physical_expr::PhysicalExpr;

use crate::error::{Error, Result};
use crate::plan::{OperatorKind, OperatorPlan};

pub use running::RunningAggregate;

pub enum Operator {
    Filter { id: String, predicate: Arc<dyn PhysicalExpr> },
    Select { id: String, exprs: Vec<Arc<dyn PhysicalExpr>>, schema: SchemaRef },
    Running(RunningAggregate),
}

impl Operator {
    /// An operator instance for one subtask.
    pub fn new(plan: &OperatorPlan, input_schema: &SchemaRef, subtask: u32, parallelism: u32, max_parallelism: u32) -> Result<Self> {
        Ok(match &plan.kind {
            OperatorKind::Filter(p) => Operator::Filter { id: plan.id.clone(), predicate: p.clone() },
            OperatorKind::Select(exprs) => Operator::Select {
                id: plan.id.clone(),
                exprs: exprs.clone(),
                schema: plan.output_schema.clone(),
            },
            OperatorKind::Running(r) => Operator::Running(RunningAggregate::new(
                plan.id.clone(),
                r,
                input_schema,
                plan.output_schema.clone(),
                subtask,
                parallelism,
                max_parallelism,
            )?),
        })
    }

    pub fn id(&self) -> &str {
        match self {
            Operator::Filter { id, .. } | Operator::Select { id, .. } => id,
            Operator::Running(r) => r.id(),
        }
    }

    /// Processes one batch; `None` when nothing is left of it.
    pub fn process(&mut self, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        match self {
            Operator::Filter { id, predicate } => {
                let mask = predicate
                    .evaluate(&batch)
                    .and_then(|v| v.into_array(batch.num_rows()))
                    .map_err(|e| Error::Job(format!("filter {id}: {}", e.strip_backtrace())))?;
                let out = filter_record_batch(&batch, mask.as_boolean()).map_err(Error::arrow(format!("filter {id}")))?;
                Ok((out.num_rows() > 0).then_some(out))
            }
            Operator::Select { id, exprs, schema } => {
                let n = batch.num_rows();
                let columns = exprs
                    .iter()
                    .map(|e| e.evaluate(&batch).and_then(|v| v.into_array(n)))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| Error::Job(format!("select {id}: {}", e.strip_backtrace())))?;
                let out = RecordBatch::try_new(schema.clone(), columns).map_err(Error::arrow(format!("select {id}")))?;
                Ok(Some(out))
            }
            Operator::Running(r) => r.process(batch).map(Some),
        }
    }

    pub fn as_keyed(&mut self) -> Option<&mut RunningAggregate> {
        match self {
            Operator::Running(r) => Some(r),
            _ => None,
        }
    }
}
