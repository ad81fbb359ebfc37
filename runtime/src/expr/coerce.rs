//! The casts DataFusion's type rules put into an expression before it can
//! be planned: both sides of `int_col > 1.5` become doubles, a function's
//! arguments the types its signature accepts, the branches of a `CASE` one
//! common type. The rules themselves are DataFusion's
//! (`datafusion_expr::type_coercion` and `datafusion_expr_common`); this
//! module applies them node by node, as DataFusion's analyzer would on the
//! whole expression. Errors say which operator or function could not take
//! which types.

use arrow::compute::can_cast_types;
use arrow::datatypes::DataType;
use datafusion_common::DFSchema;
use datafusion_expr::expr::Case;
use datafusion_expr::type_coercion::binary::{comparison_coercion, like_coercion, BinaryTypeCoercer};
use datafusion_expr::type_coercion::functions::fields_with_udf;
use datafusion_expr::type_coercion::other::{get_coerce_type_for_case_expression, get_coerce_type_for_case_when, get_coerce_type_for_list};
use datafusion_expr::type_coercion::{is_interval, is_signed_numeric, is_timestamp};
use datafusion_expr::{Expr, ExprSchemable, Operator, ScalarUDF};

type Result<T> = std::result::Result<T, String>;

fn type_of(e: &Expr, schema: &DFSchema) -> Result<DataType> {
    e.get_type(schema).map_err(|e| e.strip_backtrace())
}

fn cast(e: Expr, to: &DataType, schema: &DFSchema) -> Result<Expr> {
    e.cast_to(to, schema).map_err(|e| e.strip_backtrace())
}

/// Both operands of a binary operator, cast to the types it takes.
pub fn binary(left: Expr, op: Operator, right: Expr, schema: &DFSchema) -> Result<(Expr, Expr)> {
    let (lt, rt) = (type_of(&left, schema)?, type_of(&right, schema)?);
    let (l_to, r_to) = BinaryTypeCoercer::new(&lt, &op, &rt).get_input_types().map_err(|e| e.strip_backtrace())?;
    // Date and time arithmetic keeps its operands' types (DataFusion's
    // analyzer special-cases it); pipeline schemas have no such types, so
    // an operand that cannot be cast is an error here.
    for (from, to) in [(&lt, &l_to), (&rt, &r_to)] {
        if !can_cast_types(from, to) {
            return Err(format!("`{op}` cannot take {lt} and {rt}"));
        }
    }
    Ok((cast(left, &l_to, schema)?, cast(right, &r_to, schema)?))
}

/// The operand of `NOT` and `IS [NOT] TRUE/FALSE/UNKNOWN`: a boolean (or NULL).
pub fn to_boolean(e: Expr, schema: &DFSchema, what: &str) -> Result<Expr> {
    let t = type_of(&e, schema)?;
    BinaryTypeCoercer::new(&t, &Operator::IsDistinctFrom, &DataType::Boolean)
        .get_input_types()
        .map_err(|_| format!("{what} takes a boolean, not {t}"))?;
    cast(e, &DataType::Boolean, schema)
}

/// The operand of a unary minus: a signed number (or NULL).
pub fn negative(e: Expr, schema: &DFSchema) -> Result<Expr> {
    let t = type_of(&e, schema)?;
    if t.is_null() || is_signed_numeric(&t) || is_interval(&t) || is_timestamp(&t) {
        Ok(Expr::Negative(Box::new(e)))
    } else {
        Err(format!("a minus sign takes a signed number, not {t}"))
    }
}

/// `expr [NOT] BETWEEN low AND high`: all three in one comparable type.
pub fn between(expr: Expr, low: Expr, high: Expr, schema: &DFSchema) -> Result<(Expr, Expr, Expr)> {
    let (et, lt, ht) = (type_of(&expr, schema)?, type_of(&low, schema)?, type_of(&high, schema)?);
    let common = comparison_coercion(&et, &lt)
        .zip(comparison_coercion(&et, &ht))
        .and_then(|(a, b)| comparison_coercion(&a, &b))
        .ok_or_else(|| format!("BETWEEN cannot compare {et} with {lt} and {ht}"))?;
    Ok((cast(expr, &common, schema)?, cast(low, &common, schema)?, cast(high, &common, schema)?))
}

/// `expr [NOT] IN (list)`: the value and every element in one type.
pub fn in_list(expr: Expr, list: Vec<Expr>, schema: &DFSchema) -> Result<(Expr, Vec<Expr>)> {
    let et = type_of(&expr, schema)?;
    let types = list.iter().map(|e| type_of(e, schema)).collect::<Result<Vec<_>>>()?;
    let common = get_coerce_type_for_list(&et, &types).ok_or_else(|| {
        format!("IN cannot compare {et} with [{}]", types.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", "))
    })?;
    let list = list.into_iter().map(|e| cast(e, &common, schema)).collect::<Result<Vec<_>>>()?;
    Ok((cast(expr, &common, schema)?, list))
}

/// `expr [NOT] [I]LIKE pattern`: both strings of one type.
pub fn like(expr: Expr, pattern: Expr, schema: &DFSchema) -> Result<(Expr, Expr)> {
    let (et, pt) = (type_of(&expr, schema)?, type_of(&pattern, schema)?);
    let common = like_coercion(&et, &pt).ok_or_else(|| format!("LIKE cannot match {et} against a pattern of {pt}"))?;
    Ok((cast(expr, &common, schema)?, cast(pattern, &common, schema)?))
}

/// `CASE [operand] WHEN .. THEN .. [ELSE ..] END`: the operand and the
/// WHENs in one type (or each WHEN a boolean), the THENs and the ELSE in
/// one type.
pub fn case(operand: Option<Expr>, when_then: Vec<(Expr, Expr)>, else_result: Option<Expr>, schema: &DFSchema) -> Result<Case> {
    let then_types = when_then.iter().map(|(_, t)| type_of(t, schema)).collect::<Result<Vec<_>>>()?;
    let else_type = else_result.as_ref().map(|e| type_of(e, schema)).transpose()?;
    let result_type = get_coerce_type_for_case_expression(&then_types, else_type.as_ref()).ok_or_else(|| {
        let mut types: Vec<String> = then_types.iter().map(|t| t.to_string()).collect();
        types.extend(else_type.iter().map(|t| t.to_string()));
        format!("the results of CASE ({}) have no common type", types.join(", "))
    })?;
    let when_type = match &operand {
        Some(op) => {
            let ot = type_of(op, schema)?;
            let when_types = when_then.iter().map(|(w, _)| type_of(w, schema)).collect::<Result<Vec<_>>>()?;
            Some(get_coerce_type_for_case_when(&when_types, &ot).ok_or_else(|| {
                format!("CASE compares {ot} with WHEN values of {}", when_types.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", "))
            })?)
        }
        None => None,
    };
    let operand = match (operand, &when_type) {
        (Some(op), Some(t)) => Some(Box::new(cast(op, t, schema)?)),
        _ => None,
    };
    let when_then = when_then
        .into_iter()
        .map(|(w, t)| {
            let w = match &when_type {
                Some(wt) => cast(w, wt, schema)?,
                None => to_boolean(w, schema, "a WHEN without CASE operand")?,
            };
            Ok((Box::new(w), Box::new(cast(t, &result_type, schema)?)))
        })
        .collect::<Result<Vec<_>>>()?;
    let else_result = else_result.map(|e| cast(e, &result_type, schema).map(Box::new)).transpose()?;
    Ok(Case::new(operand, when_then, else_result))
}

/// A function's arguments, cast to the types its signature accepts.
pub fn arguments(args: Vec<Expr>, udf: &ScalarUDF, schema: &DFSchema) -> Result<Vec<Expr>> {
    let fields = args.iter().map(|e| e.to_field(schema).map(|(_, f)| f).map_err(|e| e.strip_backtrace())).collect::<Result<Vec<_>>>()?;
    let coerced = fields_with_udf(&fields, udf).map_err(|e| e.strip_backtrace())?;
    args.into_iter().zip(coerced).map(|(e, f)| cast(e, f.data_type(), schema)).collect()
}
