//! Reading JSON request bodies, shared by every protocol: a body that does not parse is a
//! 400 naming the field at fault, and integer fields take whole floats as the
//! pydantic-based servers do.

use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Parses a JSON body into `T`; syntax errors, invalid UTF-8, missing fields and wrong
/// types all become a 400 `invalid_request_error` (never axum's plain-text rejection).
pub(crate) fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if let Err(e) = std::str::from_utf8(body) {
        return Err(ApiError::invalid_request(
            format!(
                "the request body is not valid UTF-8 (invalid byte at offset {})",
                e.valid_up_to()
            ),
            None,
        ));
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_request(
            "the request body is empty; expected a JSON object",
            None,
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let value: T = match serde_path_to_error::deserialize(&mut de) {
        Ok(v) => v,
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            return Err(match inner.classify() {
                serde_json::error::Category::Data if path != "." => ApiError::invalid_request(
                    format!("invalid value for `{path}`: {inner}"),
                    Some(&path),
                ),
                serde_json::error::Category::Data => {
                    // "missing field `x`": name the field as the param.
                    let msg = inner.to_string();
                    let missing = msg
                        .strip_prefix("missing field `")
                        .and_then(|r| r.split('`').next());
                    ApiError::invalid_request(format!("invalid request: {msg}"), missing)
                }
                _ => ApiError::invalid_request(
                    format!("could not parse the JSON body of the request: {inner}"),
                    None,
                ),
            });
        }
    };
    de.end().map_err(|e| {
        ApiError::invalid_request(
            format!("could not parse the JSON body of the request: {e}"),
            None,
        )
    })?;
    Ok(value)
}

/// Integer fields as JSON may write them: `5`, or `5.0`, which JSON Schema (and so the
/// OpenAPI document, whose `integer` admits it) counts as the same integer, as the
/// pydantic-based servers (vLLM, SGLang) do. Any other number (`5.5`, one out of the
/// field's range) is refused as serde refuses it. For `#[serde(deserialize_with)]`.
pub(crate) mod whole {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::{Deserialize, Deserializer, Error, Unexpected, Visitor};

    /// An integer type a field holds.
    pub(crate) trait Int: Sized + TryFrom<i64> + TryFrom<u64> {
        const NAME: &'static str;
    }

    impl Int for i64 {
        const NAME: &'static str = "i64";
    }

    impl Int for u32 {
        const NAME: &'static str = "u32";
    }

    /// One integer, read as [`whole`](self) reads them.
    struct Whole<T>(T);

    impl<'de, T: Int> Deserialize<'de> for Whole<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(IntVisitor(PhantomData)).map(Whole)
        }
    }

    struct IntVisitor<T>(PhantomData<T>);

    impl<T: Int> Visitor<'_> for IntVisitor<T> {
        type Value = T;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(T::NAME)
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<T, E> {
            T::try_from(v).map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<T, E> {
            T::try_from(v).map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
        }

        fn visit_f64<E: Error>(self, v: f64) -> Result<T, E> {
            // Whole, and an i64 (2^63 is not): exactly that integer.
            const LIMIT: f64 = 9_223_372_036_854_775_808.0;
            if v.fract() == 0.0 && (-LIMIT..LIMIT).contains(&v) {
                self.visit_i64(v as i64)
            } else {
                Err(E::invalid_type(Unexpected::Float(v), &self))
            }
        }
    }

    pub(crate) fn int<'de, D: Deserializer<'de>, T: Int>(d: D) -> Result<T, D::Error> {
        Whole::deserialize(d).map(|w| w.0)
    }

    pub(crate) fn opt<'de, D: Deserializer<'de>, T: Int>(d: D) -> Result<Option<T>, D::Error> {
        Option::<Whole<T>>::deserialize(d).map(|o| o.map(|w| w.0))
    }

    pub(crate) fn list<'de, D: Deserializer<'de>, T: Int>(d: D) -> Result<Vec<T>, D::Error> {
        Vec::<Whole<T>>::deserialize(d).map(|v| v.into_iter().map(|w| w.0).collect())
    }

    pub(crate) fn opt_list<'de, D: Deserializer<'de>, T: Int>(
        d: D,
    ) -> Result<Option<Vec<T>>, D::Error> {
        Option::<Vec<Whole<T>>>::deserialize(d)
            .map(|o| o.map(|v| v.into_iter().map(|w| w.0).collect()))
    }

    pub(crate) fn lists<'de, D: Deserializer<'de>, T: Int>(d: D) -> Result<Vec<Vec<T>>, D::Error> {
        Vec::<Vec<Whole<T>>>::deserialize(d).map(|v| {
            v.into_iter()
                .map(|l| l.into_iter().map(|w| w.0).collect())
                .collect()
        })
    }
}
