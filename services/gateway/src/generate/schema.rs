//! The pieces of the OpenAPI schemas the derives cannot write (a closed set of strings, a
//! nullable value, a bounded string, a typed object), which the chat request, the sampling
//! fields and the protocols' bodies build their limits' schemas from.

use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{Object, ObjectBuilder, OneOfBuilder, Schema, SchemaType, Type};

pub(crate) fn strings(values: &[&str]) -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(values.iter().copied()))
        .build()
}

pub(crate) fn nullable(schema: impl Into<RefOr<Schema>>) -> Schema {
    OneOfBuilder::new()
        .item(Object::with_type(Type::Null))
        .item(schema)
        .into()
}

/// A string of 1 to `max_bytes` bytes of UTF-8: at most a quarter as many characters
/// always fit (JSON Schema counts characters).
pub(crate) fn short_string(max_bytes: usize, description: &str) -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(1))
        .max_length(Some(max_bytes / 4))
        .description(Some(format!(
            "{description} 1 to {max_bytes} bytes of UTF-8 ({} characters always fit).",
            max_bytes / 4
        )))
        .build()
}

/// The `json_schema` a response is made to match.
pub(crate) fn json_schema_fields(b: ObjectBuilder) -> ObjectBuilder {
    b.property("name", Object::with_type(Type::String))
        .required("name")
        .property("description", Object::with_type(Type::String))
        .property(
            "schema",
            ObjectBuilder::new()
                .schema_type(SchemaType::from_iter([Type::Object, Type::Null]))
                .description(Some("The JSON schema (default: any object).")),
        )
        .property(
            "strict",
            Object::with_type(SchemaType::from_iter([Type::Boolean, Type::Null])),
        )
}

pub(crate) fn typed(kind: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .property("type", strings(&[kind]))
        .required("type")
}
