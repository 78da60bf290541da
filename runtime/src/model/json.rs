//! Small typed readers over `serde_json::Value` shared by the config parsers. HF configs are
//! loosely typed (`null` for "default", ints where floats are meant, ints or lists for ids), so
//! each reader accepts what the Python side writes and returns a reason string on mismatch;
//! callers wrap it in their own error with the field name.

use serde_json::{Map, Value};

pub(crate) type Obj = Map<String, Value>;

/// `Ok(None)` when the key is absent or `null`.
pub(crate) fn opt<'a>(obj: &'a Obj, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(crate) fn usize_of(v: &Value) -> Result<usize, String> {
    if let Some(u) = v.as_u64() {
        return usize::try_from(u).map_err(|_| format!("{u} is too large"));
    }
    // Some tools write integral floats (`8.0`).
    match v.as_f64() {
        Some(f) if f >= 0.0 && f.fract() == 0.0 && f < 1e15 => Ok(f as usize),
        _ => Err(format!("expected a non-negative integer, got {v}")),
    }
}

pub(crate) fn f64_of(v: &Value) -> Result<f64, String> {
    v.as_f64()
        .ok_or_else(|| format!("expected a number, got {v}"))
}

pub(crate) fn bool_of(v: &Value) -> Result<bool, String> {
    v.as_bool()
        .ok_or_else(|| format!("expected true or false, got {v}"))
}

pub(crate) fn str_of(v: &Value) -> Result<&str, String> {
    v.as_str()
        .ok_or_else(|| format!("expected a string, got {v}"))
}

/// An int or a list of ints (`eos_token_id`, `layers_to_transform`).
pub(crate) fn usize_list_of(v: &Value) -> Result<Vec<usize>, String> {
    match v {
        Value::Array(items) => items.iter().map(usize_of).collect(),
        other => Ok(vec![usize_of(other)?]),
    }
}

pub(crate) fn get_usize(obj: &Obj, key: &str) -> Result<Option<usize>, String> {
    opt(obj, key).map(usize_of).transpose()
}

pub(crate) fn get_f64(obj: &Obj, key: &str) -> Result<Option<f64>, String> {
    opt(obj, key).map(f64_of).transpose()
}

pub(crate) fn get_bool(obj: &Obj, key: &str) -> Result<Option<bool>, String> {
    opt(obj, key).map(bool_of).transpose()
}

pub(crate) fn get_str<'a>(obj: &'a Obj, key: &str) -> Result<Option<&'a str>, String> {
    opt(obj, key).map(str_of).transpose()
}
