//! The OpenAPI pieces the protocols' routes name: schemas composed from several request
//! types, the streamed event, and each group of routes' error answers (whose components
//! `http::openapi` writes).

use std::collections::BTreeMap;

use utoipa::openapi::schema::{Object, ObjectBuilder, Schema, Type};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{IntoResponses, PartialSchema, ToSchema};

/// Declares the error answers (by component name) of a group of operations.
macro_rules! error_answers {
    ($(#[$doc:meta])* $name:ident: $($status:literal => $component:literal),+ $(,)?) => {
        $(#[$doc])*
        pub(crate) enum $name {}

        impl IntoResponses for $name {
            fn responses() -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
                [$(($status, $component)),+]
                    .into_iter()
                    .map(|(status, name)| (status.to_owned(), Ref::from_response_name(name).into()))
                    .collect()
            }
        }
    };
}

error_answers! {
    /// The generating routes' (chat completions, completions, Responses).
    GenerationErrors: "400" => "BadRequest", "401" => "Unauthorized", "404" => "NotFound",
        "413" => "PayloadTooLarge", "429" => "TooManyRequests", "503" => "Unavailable",
        "5XX" => "ServerError",
}

error_answers! {
    /// `/v1/messages`'s: Anthropic's body, except where the answer comes before the
    /// handler (the key check; a request shed for load).
    AnthropicErrors: "400" => "AnthropicBadRequest", "401" => "Unauthorized",
        "404" => "AnthropicNotFound", "413" => "AnthropicPayloadTooLarge",
        "429" => "AnthropicTooManyRequests", "503" => "AnthropicUnavailable",
        "5XX" => "AnthropicServerError",
}

error_answers! {
    /// `/tokenize` and `/detokenize`.
    TokenizeErrors: "400" => "BadRequest", "401" => "Unauthorized", "404" => "NotFound",
        "413" => "PayloadTooLarge", "503" => "Unavailable", "5XX" => "ServerError",
}

error_answers! {
    /// Routes that only need the key and a backend (`/v1/models`, `/flush_cache`).
    BackendErrors: "401" => "Unauthorized", "503" => "Unavailable", "5XX" => "ServerError",
}

error_answers! {
    /// `/v1/responses/{id}`: the gateway's own store.
    StoredErrors: "401" => "Unauthorized", "404" => "NotFound",
}

error_answers! {
    /// `/v1/models/{model}` (the served model's name comes from a worker without
    /// `--model-name`).
    LookupErrors: "401" => "Unauthorized", "404" => "NotFound", "503" => "Unavailable",
        "5XX" => "ServerError",
}

error_answers! {
    /// `/debug/*`.
    AdminErrors: "400" => "BadRequest", "401" => "Unauthorized", "403" => "Forbidden",
        "404" => "NotFound", "5XX" => "ServerError",
}

// Schemas the derives cannot write: limits held in constants, and bodies read as two
// types at once.
/// The properties of `extra` (those `keep` names) added to the object schema `base`,
/// replacing any of the same name.
pub(crate) fn merged(
    base: RefOr<Schema>,
    extra: RefOr<Schema>,
    keep: impl Fn(&str) -> bool,
) -> Object {
    let (RefOr::T(Schema::Object(mut base)), RefOr::T(Schema::Object(extra))) = (base, extra)
    else {
        unreachable!("request structs derive object schemas");
    };
    for (name, schema) in extra.properties {
        if keep(&name) {
            base.properties.insert(name, schema);
        }
    }
    base.required.extend(extra.required);
    base
}

/// Names a schema built from others (a `ToSchema` whose `schemas` registers theirs),
/// with its description.
macro_rules! composed {
    ($(#[$doc:meta])* $name:ident from [$($part:ty),+], $description:literal => $schema:expr) => {
        $(#[$doc])*
        pub(crate) enum $name {}

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                let mut schema: utoipa::openapi::schema::Schema = $schema.into();
                match &mut schema {
                    utoipa::openapi::schema::Schema::Object(o) => o.description = Some($description.into()),
                    utoipa::openapi::schema::Schema::OneOf(o) => o.description = Some($description.into()),
                    utoipa::openapi::schema::Schema::AllOf(o) => o.description = Some($description.into()),
                    _ => unreachable!("objects and compositions"),
                }
                schema.into()
            }
        }

        impl utoipa::ToSchema for $name {
            fn name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }

            fn schemas(out: &mut Vec<(String, utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>)>) {
                $(<$part as utoipa::ToSchema>::schemas(out);)+
            }
        }
    };
}

pub(crate) use composed;

/// One server-sent event of a streamed answer, as an SSE parser reads it: the schema of a
/// `text/event-stream` answer (Schemathesis checks each event against it, as OpenAPI 3.2's
/// `itemSchema` says).
pub(crate) enum SseEvent {}

impl PartialSchema for SseEvent {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .property(
                "event",
                ObjectBuilder::new().schema_type(Type::String).description(Some(
                    "The event's type: Anthropic's (`message_start`, ...) and the Responses \
                     API's (`response.created`, ...); OpenAI's chat and completion chunks have none.",
                )),
            )
            .property(
                "data",
                ObjectBuilder::new().schema_type(Type::String).description(Some(
                    "A JSON object (a chunk, an event's body, or `{\"error\": ...}` when the \
                     generation fails after the stream began); OpenAI's chat and completion \
                     streams end with `[DONE]`.",
                )),
            )
            .required("data")
            .description(Some("One server-sent event."))
            .into()
    }
}

impl ToSchema for SseEvent {}
