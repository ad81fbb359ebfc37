//! From sqlparser's syntax tree to a DataFusion logical expression, typed
//! as it is built: every node's children are coerced (`coerce.rs`) when the
//! node is made, so the finished expression needs no analyzer pass.
//!
//! What a pipeline expression may contain: columns of the input, literals
//! (numbers, strings in single quotes, `true`, `false`, `NULL`),
//! arithmetic (`+ - * / %`), comparison, `AND`/`OR`/`NOT`, `||`, bitwise
//! operators, `IS [NOT] NULL/TRUE/FALSE/UNKNOWN/DISTINCT FROM`, `[NOT]
//! BETWEEN`, `[NOT] IN (list)`, `[NOT] LIKE/ILIKE`, `CASE`, `CAST`/
//! `TRY_CAST`/`::`, and calls of DataFusion's core, math, string and
//! unicode functions (`abs`, `round`, `coalesce`, `upper`, `substr`, ...,
//! plus the SQL forms `CEIL(x)`, `FLOOR(x)`, `SUBSTRING(s FROM a FOR b)`,
//! `TRIM(...)`, `POSITION(a IN b)`). Everything else (subqueries,
//! aggregates, window functions, qualified names) is refused by name.
//! Unquoted identifiers are lower-cased, as SQL and DataFusion do;
//! `"Quoted"` ones are taken as written.

use std::sync::Arc;

use arrow::datatypes::DataType;
use datafusion_common::{Column, DFSchema, ScalarValue};
use datafusion_expr::expr::{Between, BinaryExpr, Cast, InList, Like, ScalarFunction, TryCast};
use datafusion_expr::simplify::{ExprSimplifyResult, SimplifyContext};
use datafusion_expr::{lit, Expr, Operator, ScalarUDF, Volatility};
use sqlparser::ast::{
    self as ast, BinaryOperator, CastKind, CeilFloorKind, DataType as SqlType, DateTimeField, ExactNumberInfo, FunctionArg, FunctionArgExpr, FunctionArguments, Ident,
    ObjectNamePart, TrimWhereField, UnaryOperator, Value,
};

use super::coerce;
use super::Functions;

type Result<T> = std::result::Result<T, String>;

pub(super) struct Planner<'a> {
    pub(super) schema: &'a DFSchema,
    pub(super) functions: &'a Functions,
    /// What a function's own simplification may ask about the input: some
    /// (`coalesce`, `nvl2`, `arrow_cast`) exist only as their rewrite.
    pub(super) simplify: &'a SimplifyContext,
}

impl Planner<'_> {
    pub(super) fn expr(&self, e: ast::Expr) -> Result<Expr> {
        use ast::Expr as E;
        let boxed = |e: Box<ast::Expr>| self.expr(*e);
        match e {
            E::Identifier(ident) => self.column(&ident),
            E::CompoundIdentifier(parts) => Err(format!(
                "`{}`: qualified names are not supported; a pipeline expression sees the fields of its input by their plain names",
                parts.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(".")
            )),
            E::Value(v) => literal(v.value, false),
            E::Nested(inner) => boxed(inner),
            E::UnaryOp { op: UnaryOperator::Minus, expr } => match *expr {
                E::Value(v) => literal(v.value, true),
                other => coerce::negative(self.expr(other)?, self.schema),
            },
            E::UnaryOp { op: UnaryOperator::Plus, expr } => boxed(expr),
            E::UnaryOp { op: UnaryOperator::Not, expr } => Ok(Expr::Not(Box::new(coerce::to_boolean(boxed(expr)?, self.schema, "NOT")?))),
            E::UnaryOp { op, .. } => Err(format!("the unary operator `{op}` is not supported")),
            E::BinaryOp { left, op, right } => {
                let op = operator(&op)?;
                self.binary(boxed(left)?, op, boxed(right)?)
            }
            E::IsNull(e) => Ok(Expr::IsNull(Box::new(boxed(e)?))),
            E::IsNotNull(e) => Ok(Expr::IsNotNull(Box::new(boxed(e)?))),
            E::IsTrue(e) => Ok(Expr::IsTrue(Box::new(coerce::to_boolean(boxed(e)?, self.schema, "IS TRUE")?))),
            E::IsNotTrue(e) => Ok(Expr::IsNotTrue(Box::new(coerce::to_boolean(boxed(e)?, self.schema, "IS NOT TRUE")?))),
            E::IsFalse(e) => Ok(Expr::IsFalse(Box::new(coerce::to_boolean(boxed(e)?, self.schema, "IS FALSE")?))),
            E::IsNotFalse(e) => Ok(Expr::IsNotFalse(Box::new(coerce::to_boolean(boxed(e)?, self.schema, "IS NOT FALSE")?))),
            E::IsUnknown(e) => Ok(Expr::IsUnknown(Box::new(coerce::to_boolean(boxed(e)?, self.schema, "IS UNKNOWN")?))),
            E::IsNotUnknown(e) => Ok(Expr::IsNotUnknown(Box::new(coerce::to_boolean(boxed(e)?, self.schema, "IS NOT UNKNOWN")?))),
            E::IsDistinctFrom(a, b) => self.binary(boxed(a)?, Operator::IsDistinctFrom, boxed(b)?),
            E::IsNotDistinctFrom(a, b) => self.binary(boxed(a)?, Operator::IsNotDistinctFrom, boxed(b)?),
            E::Between { expr, negated, low, high } => {
                let (expr, low, high) = coerce::between(boxed(expr)?, boxed(low)?, boxed(high)?, self.schema)?;
                Ok(Expr::Between(Between::new(Box::new(expr), negated, Box::new(low), Box::new(high))))
            }
            E::InList { expr, list, negated } => {
                let list = list.into_iter().map(|e| self.expr(e)).collect::<Result<Vec<_>>>()?;
                let (expr, list) = coerce::in_list(boxed(expr)?, list, self.schema)?;
                Ok(Expr::InList(InList::new(Box::new(expr), list, negated)))
            }
            E::Like { negated, any: false, expr, pattern, escape_char } => self.like(negated, *expr, *pattern, escape_char, false),
            E::ILike { negated, any: false, expr, pattern, escape_char } => self.like(negated, *expr, *pattern, escape_char, true),
            E::Cast { kind, expr, data_type, format: None, array: false } => {
                let to = data_type_of(&data_type)?;
                let inner = boxed(expr)?;
                Ok(match kind {
                    CastKind::Cast | CastKind::DoubleColon => Expr::Cast(Cast::new(Box::new(inner), to)),
                    CastKind::TryCast | CastKind::SafeCast => Expr::TryCast(TryCast::new(Box::new(inner), to)),
                })
            }
            E::Case { operand, conditions, else_result, .. } => {
                let operand = operand.map(boxed).transpose()?;
                let when_then = conditions
                    .into_iter()
                    .map(|c| Ok((self.expr(c.condition)?, self.expr(c.result)?)))
                    .collect::<Result<Vec<_>>>()?;
                let else_result = else_result.map(boxed).transpose()?;
                let case = coerce::case(operand, when_then, else_result, self.schema)?;
                Ok(Expr::Case(case))
            }
            E::Function(f) => self.function(f),
            E::Ceil { expr, field: CeilFloorKind::DateTimeField(DateTimeField::NoDateTime) } => self.call("ceil", vec![boxed(expr)?]),
            E::Floor { expr, field: CeilFloorKind::DateTimeField(DateTimeField::NoDateTime) } => self.call("floor", vec![boxed(expr)?]),
            E::Position { expr, r#in } => {
                // POSITION(needle IN haystack) is strpos(haystack, needle).
                let needle = boxed(expr)?;
                self.call("strpos", vec![boxed(r#in)?, needle])
            }
            E::Substring { expr, substring_from, substring_for, .. } => {
                let mut args = vec![boxed(expr)?, match substring_from {
                    Some(from) => boxed(from)?,
                    None => lit(1i64),
                }];
                if let Some(len) = substring_for {
                    args.push(boxed(len)?);
                }
                self.call("substr", args)
            }
            E::Trim { trim_where, trim_what, expr, trim_characters: None } => {
                let name = match trim_where {
                    None | Some(TrimWhereField::Both) => "btrim",
                    Some(TrimWhereField::Leading) => "ltrim",
                    Some(TrimWhereField::Trailing) => "rtrim",
                };
                let mut args = vec![boxed(expr)?];
                if let Some(what) = trim_what {
                    args.push(boxed(what)?);
                }
                self.call(name, args)
            }
            E::Subquery(_) | E::Exists { .. } | E::InSubquery { .. } => Err("subqueries are not supported in a pipeline expression".into()),
            other => Err(format!("`{other}` is not supported in a pipeline expression")),
        }
    }

    fn column(&self, ident: &Ident) -> Result<Expr> {
        let name = normalize(ident);
        if self.schema.field_with_unqualified_name(&name).is_ok() {
            return Ok(Expr::Column(Column::new_unqualified(name)));
        }
        let fields: Vec<&str> = self.schema.fields().iter().map(|f| f.name().as_str()).collect();
        let hint = fields.iter().find(|f| f.eq_ignore_ascii_case(&name)).map(|f| format!(" (did you mean \"{f}\", in double quotes?)")).unwrap_or_default();
        Err(format!("unknown column `{name}`{hint}; the input has {}", fields.join(", ")))
    }

    fn binary(&self, left: Expr, op: Operator, right: Expr) -> Result<Expr> {
        let (left, right) = coerce::binary(left, op, right, self.schema)?;
        Ok(Expr::BinaryExpr(BinaryExpr::new(Box::new(left), op, Box::new(right))))
    }

    fn like(&self, negated: bool, expr: ast::Expr, pattern: ast::Expr, escape: Option<ast::ValueWithSpan>, case_insensitive: bool) -> Result<Expr> {
        let escape_char = match escape.map(|v| v.value) {
            None => None,
            Some(Value::SingleQuotedString(s)) if s.chars().count() == 1 => s.chars().next(),
            Some(other) => return Err(format!("the ESCAPE of LIKE must be one character in single quotes, found {other}")),
        };
        let (expr, pattern) = coerce::like(self.expr(expr)?, self.expr(pattern)?, self.schema)?;
        Ok(Expr::Like(Like::new(negated, Box::new(expr), Box::new(pattern), escape_char, case_insensitive)))
    }

    fn function(&self, f: ast::Function) -> Result<Expr> {
        let name = match f.name.0.as_slice() {
            // A word SQL reads as a function without parentheses (`user`,
            // `current_date`) is a column when the input has one by that name.
            [ObjectNamePart::Identifier(ident)] if matches!(f.args, FunctionArguments::None) => return self.column(ident),
            [ObjectNamePart::Identifier(ident)] => normalize(ident),
            _ => return Err(format!("`{}`: qualified function names are not supported", f.name)),
        };
        if f.over.is_some() || f.filter.is_some() || !f.within_group.is_empty() || f.null_treatment.is_some() || !matches!(f.parameters, FunctionArguments::None) {
            return Err(format!("`{name}(...)`: window functions, FILTER and WITHIN GROUP are not supported in a pipeline expression"));
        }
        let args = match f.args {
            FunctionArguments::None => Vec::new(),
            FunctionArguments::Subquery(_) => return Err(format!("`{name}`: a subquery as argument is not supported")),
            FunctionArguments::List(list) => {
                if list.duplicate_treatment.is_some() || !list.clauses.is_empty() {
                    return Err(format!("`{name}(...)`: DISTINCT, ORDER BY and other clauses belong to aggregates, which a pipeline expression does not have"));
                }
                list.args
                    .into_iter()
                    .map(|a| match a {
                        FunctionArg::Unnamed(FunctionArgExpr::Expr(e)) => self.expr(e),
                        other => Err(format!("`{name}`: the argument `{other}` is not supported (only plain expressions)")),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        self.call(&name, args)
    }

    fn call(&self, name: &str, args: Vec<Expr>) -> Result<Expr> {
        let Some(udf) = self.functions.get(name) else {
            return Err(format!("unknown function `{name}`: a pipeline expression may call DataFusion's core, math, string and unicode functions (abs, round, coalesce, upper, substr, ...)"));
        };
        refuse_volatile(name, udf)?;
        let args = coerce::arguments(args, udf, self.schema)?;
        // DataFusion plans `coalesce(a, b)` as a CASE, `arrow_cast` as a
        // cast, ...: the function rewrites itself, as DataFusion's
        // simplifier would ask it to.
        match udf.simplify(args, self.simplify).map_err(|e| format!("`{name}`: {}", e.strip_backtrace()))? {
            ExprSimplifyResult::Simplified(e) => Ok(e),
            ExprSimplifyResult::Original(args) => Ok(Expr::ScalarFunction(ScalarFunction::new_udf(udf.clone(), args))),
        }
    }
}

/// A function whose result is not determined by its arguments would give
/// a replayed record another output than it had before the failure.
fn refuse_volatile(name: &str, udf: &Arc<ScalarUDF>) -> Result<()> {
    if udf.signature().volatility == Volatility::Volatile {
        return Err(format!(
            "`{name}` gives another value each time it is called: a record replayed after a failure would produce different output, so exactly-once results could not be reproduced; compute the value in the source instead"
        ));
    }
    Ok(())
}

/// Unquoted identifiers are case-insensitive (lower-cased), quoted ones exact.
fn normalize(ident: &Ident) -> String {
    match ident.quote_style {
        Some(_) => ident.value.clone(),
        None => ident.value.to_lowercase(),
    }
}

/// A literal; `negative` when it stood behind a unary minus, so that
/// `-9223372036854775808` is the smallest BIGINT rather than an overflow.
fn literal(v: Value, negative: bool) -> Result<Expr> {
    let sign = if negative { "-" } else { "" };
    match v {
        Value::Number(n, _) => {
            let text = format!("{sign}{n}");
            if let Ok(i) = text.parse::<i64>() {
                Ok(lit(i))
            } else if let (false, Ok(u)) = (negative, text.parse::<u64>()) {
                Ok(lit(u))
            } else {
                text.parse::<f64>().map(lit).map_err(|_| format!("`{text}` is not a number"))
            }
        }
        _ if negative => Err(format!("`-{v}`: only numbers can be negated as literals")),
        Value::SingleQuotedString(s) => Ok(lit(s)),
        Value::Boolean(b) => Ok(lit(b)),
        Value::Null => Ok(Expr::Literal(ScalarValue::Null, None)),
        other => Err(format!("the literal `{other}` is not supported; strings are written in single quotes")),
    }
}

fn operator(op: &BinaryOperator) -> Result<Operator> {
    use BinaryOperator as B;
    Ok(match op {
        B::Plus => Operator::Plus,
        B::Minus => Operator::Minus,
        B::Multiply => Operator::Multiply,
        B::Divide => Operator::Divide,
        B::Modulo => Operator::Modulo,
        B::Gt => Operator::Gt,
        B::Lt => Operator::Lt,
        B::GtEq => Operator::GtEq,
        B::LtEq => Operator::LtEq,
        B::Eq => Operator::Eq,
        B::NotEq => Operator::NotEq,
        B::And => Operator::And,
        B::Or => Operator::Or,
        B::StringConcat => Operator::StringConcat,
        B::BitwiseAnd => Operator::BitwiseAnd,
        B::BitwiseOr => Operator::BitwiseOr,
        B::BitwiseXor => Operator::BitwiseXor,
        B::PGBitwiseShiftLeft => Operator::BitwiseShiftLeft,
        B::PGBitwiseShiftRight => Operator::BitwiseShiftRight,
        other => return Err(format!("the operator `{other}` is not supported")),
    })
}

/// SQL type names as DataFusion maps them.
fn data_type_of(t: &SqlType) -> Result<DataType> {
    Ok(match t {
        SqlType::Boolean | SqlType::Bool => DataType::Boolean,
        SqlType::TinyInt(_) => DataType::Int8,
        SqlType::SmallInt(_) | SqlType::Int2(_) => DataType::Int16,
        SqlType::Int(_) | SqlType::Integer(_) | SqlType::Int4(_) => DataType::Int32,
        SqlType::BigInt(_) | SqlType::Int8(_) => DataType::Int64,
        SqlType::TinyIntUnsigned(_) => DataType::UInt8,
        SqlType::SmallIntUnsigned(_) | SqlType::Int2Unsigned(_) => DataType::UInt16,
        SqlType::IntUnsigned(_) | SqlType::IntegerUnsigned(_) | SqlType::Int4Unsigned(_) => DataType::UInt32,
        SqlType::BigIntUnsigned(_) | SqlType::Int8Unsigned(_) => DataType::UInt64,
        SqlType::Float(_) | SqlType::Real | SqlType::Float4 => DataType::Float32,
        SqlType::Double(ExactNumberInfo::None) | SqlType::DoublePrecision | SqlType::Float8 => DataType::Float64,
        SqlType::Char(_) | SqlType::Text | SqlType::String(_) | SqlType::Varchar(_) => DataType::Utf8,
        other => {
            return Err(format!(
                "CAST to {other} is not supported; use BOOLEAN, TINYINT, SMALLINT, INT, BIGINT (also UNSIGNED), REAL, DOUBLE or VARCHAR"
            ))
        }
    })
}
