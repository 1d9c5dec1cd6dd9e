//! JSON as Python's `json.dumps(ensure_ascii=False)` writes it (its separators, no HTML
//! escaping): what Hugging Face templates' `tojson` gives, and how pdmesh writes tool
//! calls and schemas into prompts.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// sort_keys=sort_keys)`, i.e. Python's separators and no HTML escaping (minijinja's
/// built-in escapes `<`, `>`, `&` and `'`, which would change prompts).
pub(crate) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if ensure_ascii == Some(true) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson(ensure_ascii=true) is not supported",
        ));
    }
    let mut out = String::new();
    py_json(value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// `json.dumps(v, ensure_ascii=False)`: Python's separators, keys in their order.
pub(crate) fn python_json(v: &serde_json::Value) -> String {
    let mut out = String::new();
    py_json(&Value::from_serialize(v), None, false, 0, &mut out)
        .expect("a JSON value always renders");
    out
}

fn py_json(
    v: &Value,
    indent: Option<usize>,
    sort: bool,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).map_err(json_err)?)
        }
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                if !f.is_finite() {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: non-finite number",
                    ));
                }
                out.push_str(&format!("{f:?}"));
            }
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                py_json(item, indent, sort, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                let key = k
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| k.to_string());
                out.push_str(&serde_json::to_string(&key).map_err(json_err)?);
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, sort, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {other}"),
            ));
        }
    }
    Ok(())
}

fn json_err(e: serde_json::Error) -> Error {
    Error::new(ErrorKind::InvalidOperation, "tojson failed").with_source(e)
}
