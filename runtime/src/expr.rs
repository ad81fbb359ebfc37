//! SQL expressions in pipelines (`filter: value % 2 = 0`,
//! `select: [key, "value * 2 AS double"]`), compiled once by DataFusion into
//! physical expressions that are evaluated on whole Arrow record batches.
//!
//! This module parses and plans; it never evaluates a row by itself. Errors
//! name the step and the expression, and carry DataFusion's message (unknown
//! column, type mismatch) with it.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, FieldRef, Schema, SchemaRef};
use datafusion_common::config::ConfigOptions;
use datafusion_common::{DFSchema, TableReference};
use datafusion_expr::execution_props::ExecutionProps;
use datafusion_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion_expr::planner::{ContextProvider, ExprPlanner};
use datafusion_expr::simplify::SimplifyContext;
use datafusion_expr::{AggregateUDF, Expr, ExprSchemable, HigherOrderUDF, ScalarUDF, TableSource, WindowUDF};
use datafusion_optimizer::simplify_expressions::ExprSimplifier;
use datafusion_physical_expr::{create_physical_expr, PhysicalExpr};
use datafusion_sql::planner::{PlannerContext, SqlToRel};
use datafusion_sql::sqlparser::ast::SelectItem;
use datafusion_sql::sqlparser::dialect::GenericDialect;
use datafusion_sql::sqlparser::parser::Parser;

use crate::error::{Error, Result};

/// The scalar functions a pipeline expression may call (DataFusion's built-in
/// math, string and core functions), and nothing else: no tables, no
/// aggregates, no variables.
struct Functions {
    scalar: HashMap<String, Arc<ScalarUDF>>,
    planners: Vec<Arc<dyn ExprPlanner>>,
    options: ConfigOptions,
}

impl Functions {
    fn new() -> Self {
        let mut scalar = HashMap::new();
        for f in datafusion_functions::all_default_functions() {
            for alias in f.aliases() {
                scalar.insert(alias.clone(), f.clone());
            }
            scalar.insert(f.name().to_string(), f);
        }
        Functions {
            scalar,
            planners: vec![Arc::new(datafusion_functions::core::planner::CoreFunctionPlanner::default())],
            options: ConfigOptions::default(),
        }
    }
}

impl ContextProvider for Functions {
    fn get_table_source(&self, name: TableReference) -> datafusion_common::Result<Arc<dyn TableSource>> {
        datafusion_common::plan_err!("pipeline expressions cannot read tables (found `{name}`)")
    }
    fn get_expr_planners(&self) -> &[Arc<dyn ExprPlanner>] {
        &self.planners
    }
    fn get_function_meta(&self, name: &str) -> Option<Arc<ScalarUDF>> {
        self.scalar.get(name).cloned()
    }
    fn get_higher_order_meta(&self, _name: &str) -> Option<Arc<HigherOrderUDF>> {
        None
    }
    fn get_aggregate_meta(&self, _name: &str) -> Option<Arc<AggregateUDF>> {
        None
    }
    fn get_window_meta(&self, _name: &str) -> Option<Arc<WindowUDF>> {
        None
    }
    fn get_variable_type(&self, _names: &[String]) -> Option<DataType> {
        None
    }
    fn options(&self) -> &ConfigOptions {
        &self.options
    }
    fn udf_names(&self) -> Vec<String> {
        self.scalar.keys().cloned().collect()
    }
    fn higher_order_function_names(&self) -> Vec<String> {
        Vec::new()
    }
    fn udaf_names(&self) -> Vec<String> {
        Vec::new()
    }
    fn udwf_names(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Compiles expressions against one input schema.
pub struct ExprCompiler {
    functions: Functions,
    schema: Arc<DFSchema>,
    props: ExecutionProps,
}

impl ExprCompiler {
    pub fn new(schema: &SchemaRef) -> Result<Self> {
        let df = DFSchema::try_from(schema.as_ref().clone()).map_err(|e| Error::Plan {
            context: "schema".into(),
            message: e.to_string(),
        })?;
        Ok(ExprCompiler {
            functions: Functions::new(),
            schema: Arc::new(df),
            props: ExecutionProps::new(),
        })
    }

    fn plan(&self, field: &str, text: &str, ast: datafusion_sql::sqlparser::ast::Expr) -> Result<(Arc<dyn PhysicalExpr>, Expr)> {
        let fail = |message: String| Error::Expression {
            field: field.to_string(),
            expr: text.to_string(),
            message,
        };
        let planner = SqlToRel::new(&self.functions);
        let logical = planner
            .sql_to_expr(ast, &self.schema, &mut PlannerContext::new())
            .map_err(|e| fail(e.strip_backtrace()))?;
        // Coercion inserts the casts that make `int_col > 1.5` well-typed;
        // the physical planner itself expects matching types.
        let context = SimplifyContext::builder().with_schema(self.schema.clone()).build();
        let simplifier = ExprSimplifier::new(context);
        let logical = simplifier
            .coerce(logical, &self.schema)
            .map_err(|e| fail(e.strip_backtrace()))?;
        let physical = create_physical_expr(&logical, &self.schema, &self.props, &PhysicalPlanningContext::default())
            .map_err(|e| fail(e.strip_backtrace()))?;
        Ok((physical, logical))
    }

    fn parse_expr(field: &str, text: &str) -> Result<datafusion_sql::sqlparser::ast::Expr> {
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
    if next.token != datafusion_sql::sqlparser::tokenizer::Token::EOF {
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
mod tests {
    use super::*;
    use arrow::array::{AsArray, Int64Array, RecordBatch};
    use arrow::datatypes::Int64Type;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("seq", DataType::Int64, false),
            Field::new("key", DataType::Int64, false),
        ]))
    }

    fn batch() -> RecordBatch {
        RecordBatch::try_new(schema(), vec![
            Arc::new(Int64Array::from(vec![0, 1, 2, 3])),
            Arc::new(Int64Array::from(vec![10, 11, 12, 13])),
        ])
        .unwrap()
    }

    #[test]
    fn a_filter_is_evaluated_on_a_whole_batch() {
        let c = ExprCompiler::new(&schema()).unwrap();
        let f = c.filter("steps[0].filter", "seq % 2 = 0 AND key > 10.5").unwrap();
        let mask = f.evaluate(&batch()).unwrap().into_array(4).unwrap();
        let mask = mask.as_boolean();
        assert_eq!((0..4).map(|i| mask.value(i)).collect::<Vec<_>>(), vec![false, false, true, false]);
    }

    #[test]
    fn select_items_get_their_alias_or_column_name() {
        let c = ExprCompiler::new(&schema()).unwrap();
        let (e, f) = c.select_item("s", "key * 2 + abs(seq) AS double").unwrap();
        assert_eq!(f.name(), "double");
        let out = e.evaluate(&batch()).unwrap().into_array(4).unwrap();
        assert_eq!(out.as_primitive::<Int64Type>().values().to_vec(), vec![20, 23, 26, 29]);
        let (_, f) = c.select_item("s", "seq").unwrap();
        assert_eq!(f.name(), "seq");
    }

    #[test]
    fn an_unknown_column_is_named_in_the_error() {
        let c = ExprCompiler::new(&schema()).unwrap();
        let err = c.filter("steps[1].filter", "nope > 1").unwrap_err().to_string();
        assert!(err.contains("steps[1].filter") && err.contains("nope"), "{err}");
    }

    #[test]
    fn a_non_boolean_filter_is_rejected() {
        let c = ExprCompiler::new(&schema()).unwrap();
        let err = c.filter("f", "seq + 1").unwrap_err().to_string();
        assert!(err.contains("true or false"), "{err}");
    }

    #[test]
    fn trailing_garbage_is_rejected() {
        let c = ExprCompiler::new(&schema()).unwrap();
        assert!(c.filter("f", "seq > 1 seq").is_err());
        assert!(c.select_item("s", "seq + 1").unwrap_err().to_string().contains("AS name"));
    }
}
