//! SQL expressions in pipelines (`filter: value % 2 = 0`,
//! `select: [key, "value * 2 AS double"]`), compiled once into DataFusion
//! physical expressions that are evaluated on whole Arrow record batches.
//!
//! The text is parsed by `sqlparser` (the SQL parser DataFusion itself
//! uses); `sql.rs` turns the syntax tree into a DataFusion logical
//! expression, `coerce.rs` inserts the casts DataFusion's type rules ask
//! for (`int_col > 1.5` compares as doubles), and DataFusion plans the
//! physical expression. DataFusion's own SQL planner and optimizer are
//! deliberately not used: they bring DataFusion's whole function library
//! (nested types, aggregates, hashes, dates, regular expressions) and its
//! query optimizer into the build, most of a cold build's DataFusion time,
//! for the handful of constructs a per-record expression has.
//!
//! This module parses and plans; it never evaluates a row by itself. Errors
//! name the step and the expression, and say what is wrong (unknown column,
//! type mismatch, an unsupported construct). Functions whose result is not
//! determined by their arguments (`random()`, `uuid()`, `now()`) are
//! refused: a record replayed after a failure must produce the same output,
//! or exactly-once output could not be reproduced.

mod coerce;
mod sql;

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, FieldRef, Schema, SchemaRef};
use datafusion_common::DFSchema;
use datafusion_expr::execution_props::ExecutionProps;
use datafusion_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion_expr::simplify::SimplifyContext;
use datafusion_expr::{Expr, ExprSchemable, ScalarUDF};
use datafusion_physical_expr::{create_physical_expr, PhysicalExpr};
use sqlparser::ast::SelectItem;
use sqlparser::dialect::GenericDialect;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::Token;

use crate::error::{Error, Result};

/// The scalar functions a pipeline expression may call: DataFusion's core,
/// math, string and unicode functions, by name and alias.
struct Functions {
    by_name: HashMap<String, Arc<ScalarUDF>>,
}

impl Functions {
    fn new() -> Self {
        let mut by_name = HashMap::new();
        for f in datafusion_functions::all_default_functions() {
            for alias in f.aliases() {
                by_name.insert(alias.clone(), f.clone());
            }
            by_name.insert(f.name().to_string(), f);
        }
        Functions { by_name }
    }

    fn get(&self, name: &str) -> Option<&Arc<ScalarUDF>> {
        self.by_name.get(name)
    }
}

/// Compiles expressions against one input schema.
pub struct ExprCompiler {
    functions: Functions,
    schema: Arc<DFSchema>,
    props: ExecutionProps,
    simplify: SimplifyContext,
}

impl ExprCompiler {
    pub fn new(schema: &SchemaRef) -> Result<Self> {
        let df = DFSchema::try_from(schema.as_ref().clone()).map_err(|e| Error::Plan {
            context: "schema".into(),
            message: e.to_string(),
        })?;
        let schema = Arc::new(df);
        Ok(ExprCompiler {
            functions: Functions::new(),
            simplify: SimplifyContext::builder().with_schema(schema.clone()).build(),
            schema,
            props: ExecutionProps::new(),
        })
    }

    fn plan(&self, field: &str, text: &str, ast: sqlparser::ast::Expr) -> Result<(Arc<dyn PhysicalExpr>, Expr)> {
        let fail = |message: String| Error::Expression {
            field: field.to_string(),
            expr: text.to_string(),
            message,
        };
        let logical = sql::Planner { schema: &self.schema, functions: &self.functions, simplify: &self.simplify }.expr(ast).map_err(fail)?;
        let physical = create_physical_expr(&logical, &self.schema, &self.props, &PhysicalPlanningContext::default())
            .map_err(|e| fail(e.strip_backtrace()))?;
        Ok((physical, logical))
    }

    fn parse_expr(field: &str, text: &str) -> Result<sqlparser::ast::Expr> {
        let mut parser = Parser::new(&GenericDialect {})
            .try_with_sql(text)
            .map_err(|e| Error::Expression { field: field.into(), expr: text.into(), message: e.to_string() })?;
        let expr = parser
            .parse_expr()
            .map_err(|e| Error::Expression { field: field.into(), expr: text.into(), message: e.to_string() })?;
        ensure_consumed(&mut parser, field, text)?;
        Ok(expr)
    }

    /// A boolean expression for `filter`.
    pub fn filter(&self, field: &str, text: &str) -> Result<Arc<dyn PhysicalExpr>> {
        let ast = Self::parse_expr(field, text)?;
        let (physical, logical) = self.plan(field, text, ast)?;
        let ty = logical.get_type(self.schema.as_ref()).map_err(|e| Error::Expression {
            field: field.into(),
            expr: text.into(),
            message: e.strip_backtrace(),
        })?;
        if ty != DataType::Boolean {
            return Err(Error::Expression {
                field: field.into(),
                expr: text.into(),
                message: format!("a filter must be true or false for each record, but this expression gives {ty}"),
            });
        }
        Ok(physical)
    }

    /// One `select` item: `expr` or `expr AS name`. Returns the expression and its output field.
    pub fn select_item(&self, field: &str, text: &str) -> Result<(Arc<dyn PhysicalExpr>, FieldRef)> {
        let fail = |message: String| Error::Expression { field: field.into(), expr: text.into(), message };
        let mut parser = Parser::new(&GenericDialect {})
            .try_with_sql(text)
            .map_err(|e| fail(e.to_string()))?;
        let item = parser.parse_select_item().map_err(|e| fail(e.to_string()))?;
        ensure_consumed(&mut parser, field, text)?;
        let (ast, alias) = match item {
            SelectItem::UnnamedExpr(e) => (e, None),
            SelectItem::ExprWithAlias { expr, alias } => (expr, Some(alias.value)),
            _ => return Err(fail("expected an expression, optionally followed by `AS name` (wildcards are not supported)".into())),
        };
        let (physical, logical) = self.plan(field, text, ast)?;
        let name = match alias {
            Some(a) => a,
            None => match &logical {
                Expr::Column(c) => c.name.clone(),
                _ => return Err(fail("a computed value needs a name: write `... AS name`".into())),
            },
        };
        let (_, field_of) = logical.to_field(self.schema.as_ref()).map_err(|e| fail(e.strip_backtrace()))?;
        Ok((physical, Arc::new(Field::new(name, field_of.data_type().clone(), field_of.is_nullable()))))
    }
}

fn ensure_consumed(parser: &mut Parser, field: &str, text: &str) -> Result<()> {
    let next = parser.peek_token();
    if next.token != Token::EOF {
        return Err(Error::Expression {
            field: field.into(),
            expr: text.into(),
            message: format!("unexpected `{next}` after the end of the expression"),
        });
    }
    Ok(())
}

/// The schema a `select` produces.
pub fn select_schema(fields: &[FieldRef]) -> SchemaRef {
    Arc::new(Schema::new(fields.to_vec()))
}

#[cfg(test)]
mod tests;
