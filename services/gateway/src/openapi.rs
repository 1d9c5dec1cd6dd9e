//! The gateway's OpenAPI 3.1 document, served at `GET /openapi.json`: every route, its
//! request body (derived from the types the handlers deserialize, with the limits the
//! handlers check), the API-key security scheme and the error answers.
//!
//! The request types derive `utoipa::ToSchema`; what a derive cannot say is written here
//! from the same types and constants: the chat and completions bodies are one object
//! with [`SamplingFields`] (read from the same JSON), the Responses body lists what its
//! field check lets through, and the few fields whose limits are in constants (roles,
//! stop strings, salts, metadata) get their schemas from those constants.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::LazyLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use utoipa::openapi::schema::{
    AdditionalProperties, AllOfBuilder, ArrayBuilder, Object, ObjectBuilder, OneOfBuilder, Schema,
    SchemaType, Type,
};
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{
    ContentBuilder, HeaderBuilder, OpenApi as Document, Ref, RefOr, ResponseBuilder,
};
use utoipa::{IntoResponses, Modify, OpenApi, PartialSchema, ToSchema};

use crate::anthropic::AnthropicErrorBody;
use crate::error::ErrorBody;
use crate::openai::{self, ChatRequest, CompletionRequest, SamplingFields, TokenizeRequest};
use crate::responses::{self, CallIn, MessageIn, OutputIn, ReasoningIn, ResponsesRequest};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "pdmesh gateway",
        description = "OpenAI-compatible (and Anthropic Messages) HTTP API of a pdmesh mesh. \
            With `--api-key`, the `/v1/*`, `/tokenize`, `/detokenize` and `/flush_cache` routes \
            need `Authorization: Bearer <key>` (or `x-api-key: <key>`); `/debug/*` needs the \
            `--admin-key` instead. Every error is `{\"error\": {\"message\", \"type\", \"param\", \
            \"code\"}}` (`/v1/messages`: Anthropic's shape), its `param` (or message) naming the \
            field at fault.",
        license(name = "Apache-2.0"),
    ),
    paths(
        crate::handlers::chat_completions,
        crate::handlers::completions,
        crate::anthropic::messages,
        crate::responses::create,
        crate::responses::get,
        crate::responses::delete,
        crate::handlers::list_models,
        crate::handlers::get_model,
        crate::handlers::tokenize,
        crate::handlers::detokenize,
        crate::handlers::flush_cache,
        crate::handlers::health,
        crate::handlers::ready,
        crate::handlers::live,
        crate::handlers::metrics,
        openapi_json,
        crate::handlers::list_incidents,
        crate::handlers::get_incident,
    ),
    components(schemas(ErrorBody, AnthropicErrorBody)),
    modifiers(&Components),
    tags(
        (name = "OpenAI", description = "OpenAI's API: chat completions, completions, Responses, models."),
        (name = "Anthropic", description = "Anthropic's Messages API."),
        (name = "Tokens", description = "vLLM's tokenizer routes and SGLang's cache flush."),
        (name = "Operations", description = "Health, readiness, metrics and this document."),
        (name = "Admin", description = "Incident reports, with the `--admin-key`."),
    ),
)]
pub(crate) struct ApiDoc;

/// The document as served (built once).
pub(crate) fn document() -> &'static str {
    static DOC: LazyLock<String> = LazyLock::new(|| {
        ApiDoc::openapi()
            .to_json()
            .expect("the OpenAPI document serializes")
    });
    &DOC
}

/// This document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "Operations",
    responses((status = 200, description = "This OpenAPI 3.1 document.", body = Object)),
)]
pub(crate) async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], document()).into_response()
}

/// The security schemes and the error answers the operations refer to.
struct Components;

/// The error answers: (component name, description, the body's schemas).
const ERRORS: [(&str, &str, &[&str]); 14] = [
    (
        "BadRequest",
        "The request is invalid: `error.param` names the field at fault and `error.message` says why.",
        &["ErrorBody"],
    ),
    (
        "Unauthorized",
        "No API key, or a wrong one.",
        &["ErrorBody"],
    ),
    (
        "Forbidden",
        "The route is closed: the gateway has no `--admin-key`.",
        &["ErrorBody"],
    ),
    (
        "NotFound",
        "The model (`error.param` is `model`), or what the path names, does not exist.",
        &["ErrorBody"],
    ),
    (
        "PayloadTooLarge",
        "The body is larger than the gateway's `--max-body-bytes`.",
        &["ErrorBody"],
    ),
    (
        "TooManyRequests",
        "A worker's queue is full; retry after `Retry-After` seconds.",
        &["ErrorBody"],
    ),
    (
        "Unavailable",
        "The gateway already serves its `--max-concurrent-requests` (retry after `Retry-After` \
         seconds), or a backend cannot be reached.",
        &["ErrorBody"],
    ),
    (
        "ServerError",
        "The mesh failed: a backend's error or time-out, or model output that does not parse.",
        &["ErrorBody"],
    ),
    (
        "AnthropicBadRequest",
        "The request is invalid: the message names the field at fault.",
        &["AnthropicErrorBody"],
    ),
    (
        "AnthropicNotFound",
        "The model does not exist.",
        &["AnthropicErrorBody"],
    ),
    (
        "AnthropicPayloadTooLarge",
        "The body is larger than the gateway's `--max-body-bytes`.",
        &["AnthropicErrorBody"],
    ),
    (
        "AnthropicTooManyRequests",
        "A worker's queue is full; retry after `Retry-After` seconds.",
        &["AnthropicErrorBody"],
    ),
    (
        "AnthropicUnavailable",
        "The gateway already serves its `--max-concurrent-requests` (the OpenAI-shaped body, \
         with `Retry-After`), or a backend cannot be reached.",
        &["ErrorBody", "AnthropicErrorBody"],
    ),
    (
        "AnthropicServerError",
        "The mesh failed: a backend's error or time-out, or model output that does not parse.",
        &["AnthropicErrorBody"],
    ),
];

impl Modify for Components {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("The gateway's `--api-key`."))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "api_key",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "x-api-key",
                "The gateway's `--api-key`, as Anthropic's clients send it.",
            ))),
        );
        components.add_security_scheme(
            "admin",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("The gateway's `--admin-key`."))
                    .build(),
            ),
        );
        if let Some(blocks) = components.schemas.get_mut("AnthropicContentBlock") {
            drop_serde_other(blocks);
        }
        for (name, description, bodies) in ERRORS {
            let schema: RefOr<Schema> = match bodies {
                [one] => Ref::from_schema_name(*one).into(),
                many => many
                    .iter()
                    .fold(OneOfBuilder::new(), |o, b| {
                        o.item(Ref::from_schema_name(*b))
                    })
                    .into(),
            };
            let mut response = ResponseBuilder::new().description(description).content(
                "application/json",
                ContentBuilder::new().schema(Some(schema)).build(),
            );
            if name.ends_with("TooManyRequests") || name.ends_with("Unavailable") {
                response = response.header(
                    "Retry-After",
                    HeaderBuilder::new()
                        .schema(ObjectBuilder::new().schema_type(Type::Integer))
                        .description(Some("Seconds to wait before retrying (when overloaded)."))
                        .build(),
                );
            }
            components
                .responses
                .insert(name.to_owned(), response.build().into());
        }
    }
}

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

fn strings(values: &[&str]) -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(values.iter().copied()))
        .build()
}

fn nullable(schema: impl Into<RefOr<Schema>>) -> Schema {
    OneOfBuilder::new()
        .item(Object::with_type(Type::Null))
        .item(schema)
        .into()
}

/// A string of 1 to `max_bytes` bytes of UTF-8: at most a quarter as many characters
/// always fit (JSON Schema counts characters).
fn short_string(max_bytes: usize, description: &str) -> Object {
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

fn stop_string() -> Object {
    short_string(openai::MAX_STOP_BYTES, "A stop string:")
}

/// `ChatMessage.role`.
pub(crate) fn chat_role() -> Object {
    strings(&openai::ROLES)
}

/// `ContentPart.kind`: the parts served.
pub(crate) fn chat_part_type() -> Object {
    strings(&["text"])
}

/// `MessageIn.role` (Responses).
pub(crate) fn responses_role() -> Object {
    strings(&responses::ROLES)
}

/// `InMessage.role` (Anthropic).
pub(crate) fn anthropic_role() -> Object {
    strings(&["user", "assistant"])
}

/// `SamplingFields.stop`: a string or a list of them.
pub(crate) fn stop() -> Schema {
    let list = ArrayBuilder::new()
        .items(stop_string())
        .max_items(Some(openai::MAX_STOP));
    let schema = OneOfBuilder::new()
        .item(stop_string())
        .item(list)
        .description(Some(format!(
            "Strings that end the answer where the model writes one: one, or a list of at most {}.",
            openai::MAX_STOP
        )));
    nullable(schema)
}

/// `stop_sequences` (Anthropic): what the chat endpoint's `stop` takes, as a list.
pub(crate) fn stop_sequences() -> Schema {
    ArrayBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Array, Type::Null]))
        .items(stop_string())
        .max_items(Some(openai::MAX_STOP))
        .description(Some(format!(
            "Strings that end the answer where the model writes one (at most {}).",
            openai::MAX_STOP
        )))
        .into()
}

/// `SamplingFields.logit_bias`.
pub(crate) fn logit_bias() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Object, Type::Null]))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some("^(0|[1-9][0-9]{0,8})$")),
        ))
        .additional_properties(Some(
            ObjectBuilder::new()
                .schema_type(Type::Number)
                .minimum(Some(-100))
                .maximum(Some(100)),
        ))
        .description(Some(
            "Token id (a string, as JSON's keys are) → a bias in [-100, 100] added to its \
             logit. The ids must be in the model's vocabulary.",
        ))
        .build()
}

/// `SamplingFields.cache_salt`.
pub(crate) fn cache_salt() -> Schema {
    nullable(short_string(
        openai::MAX_CACHE_SALT_BYTES,
        "vLLM's prefix-cache salt: requests with different salts never share cached KV.",
    ))
}

/// `CompletionRequest.prompt`: text, token ids, or a batch of one of either.
pub(crate) fn prompt() -> Schema {
    let id = || {
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(0))
            .maximum(Some(u32::MAX))
    };
    let ids = || ArrayBuilder::new().items(id()).min_items(Some(1));
    let text = || {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
    };
    OneOfBuilder::new()
        .item(text())
        .item(ids())
        .item(
            ArrayBuilder::new()
                .items(text())
                .min_items(Some(1))
                .max_items(Some(1)),
        )
        .item(
            ArrayBuilder::new()
                .items(ids())
                .min_items(Some(1))
                .max_items(Some(1)),
        )
        .description(Some(
            "Text, token ids (each below the vocabulary size), or a list of one of either \
             (one prompt per request).",
        ))
        .into()
}

/// The `json_schema` a response is made to match.
fn json_schema_fields(b: ObjectBuilder) -> ObjectBuilder {
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

fn typed(kind: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .property("type", strings(&[kind]))
        .required("type")
}

/// `ChatRequest.response_format`.
pub(crate) fn response_format() -> Schema {
    nullable(
        OneOfBuilder::new()
            .item(typed("text"))
            .item(typed("json_object"))
            .item(
                typed("json_schema")
                    .property("json_schema", json_schema_fields(ObjectBuilder::new()))
                    .required("json_schema"),
            )
            .description(Some(
                "The answer is made to match: any text, a JSON object, or a JSON schema.",
            )),
    )
}

/// `TextConfig.format` (Responses): as `response_format`, the schema's fields inline.
pub(crate) fn text_format() -> Schema {
    nullable(
        OneOfBuilder::new()
            .item(typed("text"))
            .item(typed("json_object"))
            .item(json_schema_fields(typed("json_schema")))
            .description(Some(
                "The answer is made to match: any text, a JSON object, or a JSON schema.",
            )),
    )
}

/// `ReasoningConfig.effort` (Responses).
pub(crate) fn reasoning_effort() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
        .enum_values(Some(
            responses::EFFORTS
                .iter()
                .map(|e| json!(e))
                .chain([serde_json::Value::Null]),
        ))
        .build()
}

/// `ResponsesRequest.metadata`.
pub(crate) fn metadata() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Object, Type::Null]))
        .max_properties(Some(responses::MAX_METADATA_PAIRS))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .max_length(Some(responses::MAX_METADATA_KEY)),
        ))
        .additional_properties(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .max_length(Some(responses::MAX_METADATA_VALUE)),
        ))
        .description(Some("Stored with the response and returned with it."))
        .build()
}

/// The properties of `extra` (those `keep` names) added to the object schema `base`,
/// replacing any of the same name.
fn merged(base: RefOr<Schema>, extra: RefOr<Schema>, keep: impl Fn(&str) -> bool) -> Object {
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

        impl PartialSchema for $name {
            fn schema() -> RefOr<Schema> {
                let mut schema: Schema = $schema.into();
                match &mut schema {
                    Schema::Object(o) => o.description = Some($description.into()),
                    Schema::OneOf(o) => o.description = Some($description.into()),
                    Schema::AllOf(o) => o.description = Some($description.into()),
                    _ => unreachable!("objects and compositions"),
                }
                schema.into()
            }
        }

        impl ToSchema for $name {
            fn name() -> Cow<'static, str> {
                stringify!($name).into()
            }

            fn schemas(out: &mut Vec<(String, RefOr<Schema>)>) {
                $(<$part as ToSchema>::schemas(out);)+
            }
        }
    };
}

composed! {
    /// `POST /v1/chat/completions`'s body: [`ChatRequest`] and [`SamplingFields`].
    ChatCompletionRequest from [ChatRequest, SamplingFields],
        "The body of `POST /v1/chat/completions`: OpenAI's fields and vLLM's extra sampling fields." =>
        merged(ChatRequest::schema(), SamplingFields::schema(), |_| true)
}

composed! {
    /// `POST /v1/completions`'s body: [`CompletionRequest`] and [`SamplingFields`].
    CompletionsRequest from [CompletionRequest, SamplingFields],
        "The body of `POST /v1/completions`: OpenAI's fields and vLLM's extra sampling fields." =>
        merged(CompletionRequest::schema(), SamplingFields::schema(), |_| true)
}

composed! {
    /// `POST /v1/responses`'s body: [`ResponsesRequest`], the sampling fields it acts on
    /// and what it accepts without acting on; any other field only as null.
    ResponseCreateRequest from [ResponsesRequest, SamplingFields],
        "The body of `POST /v1/responses`. Fields not listed here are refused (a 400 naming \
         them) unless null." => {
        let mut o = merged(ResponsesRequest::schema(), SamplingFields::schema(), |name| {
            responses::FIELDS.contains(&name)
        });
        for name in responses::IGNORED {
            o.properties.entry(name.to_owned()).or_insert_with(|| {
                ObjectBuilder::new()
                    .schema_type(SchemaType::AnyValue)
                    .description(Some("Accepted and not acted on."))
                    .into()
            });
        }
        let only = |kind: Type, value: serde_json::Value, what: &str| {
            ObjectBuilder::new()
                .schema_type(SchemaType::from_iter([kind, Type::Null]))
                .enum_values(Some([value, serde_json::Value::Null]))
                .description(Some(what))
                .build()
        };
        o.properties.insert(
            "background".into(),
            only(Type::Boolean, json!(false), "Only false: responses are not run in the background.").into(),
        );
        o.properties.insert(
            "truncation".into(),
            only(Type::String, json!("disabled"), "Only `disabled`: a conversation past the context is a 400.").into(),
        );
        o.properties.insert(
            "include".into(),
            ArrayBuilder::new()
                .schema_type(SchemaType::from_iter([Type::Array, Type::Null]))
                .max_items(Some(0))
                .description(Some("Only empty: no `include` values are supported."))
                .build()
                .into(),
        );
        o.additional_properties = Some(Box::new(AdditionalProperties::RefOr(
            Object::with_type(Type::Null).into(),
        )));
        o
    }
}

composed! {
    /// `POST /tokenize`'s body: [`TokenizeRequest`], with what `TokenizeRequest::input`
    /// checks: exactly one of `prompt` and `messages` (null is absent, as serde reads it),
    /// and the fields that go with each.
    TokenizeBody from [TokenizeRequest],
        "The body of `POST /tokenize`: a `prompt`, or `messages` (with `tools`) rendered by \
         the chat template." => {
        let null = || Object::with_type(Type::Null);
        let prompt = ObjectBuilder::new()
            .property("prompt", Object::with_type(Type::String))
            .required("prompt")
            .property("messages", null())
            .property("add_generation_prompt", null())
            .property("tools", null());
        let messages = ObjectBuilder::new()
            .property(
                "messages",
                ArrayBuilder::new().min_items(Some(1)).items(Object::new()),
            )
            .required("messages")
            .property("prompt", null())
            .property(
                "add_special_tokens",
                ObjectBuilder::new()
                    .schema_type(SchemaType::from_iter([Type::Boolean, Type::Null]))
                    .enum_values(Some([json!(false), serde_json::Value::Null])),
            )
            .property(
                "add_generation_prompt",
                ObjectBuilder::new()
                    .schema_type(SchemaType::from_iter([Type::Boolean, Type::Null]))
                    .enum_values(Some([json!(true), serde_json::Value::Null])),
            );
        AllOfBuilder::new()
            .item(TokenizeRequest::schema())
            .item(OneOfBuilder::new().item(prompt).item(messages))
    }
}

composed! {
    /// An input item of `POST /v1/responses`, by its `type` (`message` when it has none).
    ResponseInputItem from [MessageIn, CallIn, OutputIn, ReasoningIn],
        "An input item, by its `type` (`message` when it has none)." => {
        let with_type = |schema: RefOr<Schema>, kind: &str, required: bool, what: &str| {
            let RefOr::T(Schema::Object(mut o)) = schema else {
                unreachable!("input item structs derive object schemas");
            };
            o.properties.insert("type".into(), strings(&[kind]).into());
            if required {
                o.required.push("type".into());
            }
            o.description = Some(what.into());
            o
        };
        OneOfBuilder::new()
            .item(with_type(MessageIn::schema(), "message", false, "A message."))
            .item(with_type(CallIn::schema(), "function_call", true, "A function call the model made."))
            .item(with_type(OutputIn::schema(), "function_call_output", true, "A function call's result."))
            .item(with_type(ReasoningIn::schema(), "reasoning", true, "The model's reasoning, given back."))
    }
}

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

/// Drops the alternative utoipa writes for a `#[serde(other)]` variant (the tag `other`)
/// from a tagged enum's schema: that variant reads the blocks the gateway then refuses
/// with a 400 naming them, so the document shows only the ones it serves (as it shows
/// only the roles it serves).
fn drop_serde_other(schema: &mut RefOr<Schema>) {
    let RefOr::T(Schema::OneOf(one_of)) = schema else {
        return;
    };
    one_of.items.retain(|item| {
        let RefOr::T(Schema::Object(o)) = item else {
            return true;
        };
        let tag = o.properties.get("type").and_then(|t| match t {
            RefOr::T(Schema::Object(t)) => t.enum_values.as_deref(),
            _ => None,
        });
        tag != Some(&[json!("other")])
    });
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use serde_json::Value;
    use tower::ServiceExt as _;

    use super::*;
    use crate::backend::Backends;
    use crate::state::AppState;

    /// Every route `handlers::router` serves: (method, path as the router writes it, a
    /// path that reaches it, whether it needs the API key (else the admin key, or none)).
    const ROUTES: [(&str, &str, &str, Key); 19] = [
        (
            "post",
            "/v1/chat/completions",
            "/v1/chat/completions",
            Key::Api,
        ),
        ("post", "/v1/completions", "/v1/completions", Key::Api),
        ("post", "/v1/messages", "/v1/messages", Key::Api),
        ("post", "/v1/responses", "/v1/responses", Key::Api),
        (
            "get",
            "/v1/responses/{id}",
            "/v1/responses/resp_1",
            Key::Api,
        ),
        (
            "delete",
            "/v1/responses/{id}",
            "/v1/responses/resp_1",
            Key::Api,
        ),
        ("get", "/v1/models", "/v1/models", Key::Api),
        ("get", "/v1/models/{model}", "/v1/models/m", Key::Api),
        ("post", "/tokenize", "/tokenize", Key::Api),
        ("post", "/detokenize", "/detokenize", Key::Api),
        ("post", "/flush_cache", "/flush_cache", Key::Api),
        ("get", "/debug/incidents", "/debug/incidents", Key::Admin),
        (
            "get",
            "/debug/incidents/{id}",
            "/debug/incidents/i1",
            Key::Admin,
        ),
        ("get", "/health", "/health", Key::None),
        ("get", "/ready", "/ready", Key::None),
        ("get", "/live", "/live", Key::None),
        ("get", "/metrics", "/metrics", Key::None),
        ("get", "/openapi.json", "/openapi.json", Key::None),
        // Not a route: what the fallback answers, to tell the routes from it.
        ("get", "", "/no/such/route", Key::None),
    ];

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Key {
        Api,
        Admin,
        None,
    }

    fn doc() -> Value {
        serde_json::from_str(document()).expect("the document is JSON")
    }

    /// A gateway whose backends refuse every connection, with an API key and an admin key.
    fn router(refusing: &pdmesh_testkit::Refusing) -> axum::Router {
        let url = refusing.url();
        let mut cfg = crate::Config::new(&url, &url);
        cfg.tls = pdmesh_tls::test_ca::args();
        cfg.api_key = Some("sk-test".into());
        cfg.admin_key = Some("admin-test".into());
        let backends = Backends::connect_lazy(&url, &url).unwrap();
        let st = AppState::new(cfg, backends, None, Default::default()).unwrap();
        crate::handlers::router(st)
    }

    async fn send(app: &axum::Router, method: &str, uri: &str) -> (StatusCode, Vec<u8>) {
        let req = Request::builder()
            .method(Method::from_bytes(method.to_uppercase().as_bytes()).unwrap())
            .uri(uri)
            .body(Body::empty())
            .unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, body.to_vec())
    }

    #[tokio::test]
    async fn every_route_is_served_and_documented_with_its_security() {
        let refusing = pdmesh_testkit::Refusing::new();
        let app = router(&refusing);
        let doc = doc();
        let paths = doc["paths"].as_object().unwrap();
        for (method, path, uri, key) in ROUTES {
            let (status, body) = send(&app, method, uri).await;
            let body: Value = serde_json::from_slice(&body).unwrap_or_default();
            // The fallback's answer (404 "no route for ...") and 405 mean no route here.
            let fallback = status == StatusCode::METHOD_NOT_ALLOWED
                || body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("no route for"));
            if path.is_empty() {
                assert!(fallback, "{uri}: {status} {body}");
                continue;
            }
            assert!(!fallback, "{method} {uri} is not served: {status} {body}");
            // Without a key, a route that needs one answers 401 before its handler runs.
            assert_eq!(
                status == StatusCode::UNAUTHORIZED,
                key != Key::None,
                "{method} {uri}: {status} {body}"
            );
            let op = &paths
                .get(path)
                .unwrap_or_else(|| panic!("{path} is not in the document"))[method];
            assert!(op.is_object(), "{method} {path} is not in the document");
            let security: Vec<&str> = op["security"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|s| s.as_object().unwrap().keys().map(String::as_str))
                .collect();
            let want: &[&str] = match key {
                Key::Api => &["bearer", "api_key"],
                Key::Admin => &["admin"],
                Key::None => &[],
            };
            assert_eq!(security, want, "{method} {path}'s security");
            if key != Key::None {
                assert!(
                    op["responses"]["401"].is_object(),
                    "{method} {path} does not document its 401"
                );
            }
        }
        // And the document has no operation the router does not serve.
        let documented: Vec<(String, String)> = paths
            .iter()
            .flat_map(|(p, item)| {
                item.as_object()
                    .unwrap()
                    .keys()
                    .map(move |m| (m.clone(), p.clone()))
            })
            .collect();
        let served: Vec<(String, String)> = ROUTES
            .iter()
            .filter(|r| !r.1.is_empty())
            .map(|(m, p, _, _)| (m.to_string(), p.to_string()))
            .collect();
        let sorted = |mut v: Vec<(String, String)>| {
            v.sort();
            v
        };
        assert_eq!(sorted(documented), sorted(served));
    }

    #[tokio::test]
    async fn the_document_is_served_without_a_key_as_openapi_3_1() {
        let refusing = pdmesh_testkit::Refusing::new();
        let (status, body) = send(&router(&refusing), "get", "/openapi.json").await;
        assert_eq!(status, StatusCode::OK);
        let served: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(served, doc());
        assert!(
            served["openapi"].as_str().unwrap().starts_with("3.1"),
            "{}",
            served["openapi"]
        );
        // Every reference resolves.
        let text = document();
        for (i, _) in text.match_indices("\"$ref\":\"#/components/") {
            let rest = &text[i + "\"$ref\":\"#/components/".len()..];
            let target = &rest[..rest.find('"').unwrap()];
            let (kind, name) = target.split_once('/').unwrap();
            assert!(
                served["components"][kind][name].is_object(),
                "dangling reference to {target}"
            );
        }
        for scheme in ["bearer", "api_key", "admin"] {
            assert!(served["components"]["securitySchemes"][scheme].is_object());
        }
        assert_eq!(
            served["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
    }

    fn request_schema(doc: &Value, method: &str, path: &str) -> Value {
        let body =
            &doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"];
        let name = body["$ref"]
            .as_str()
            .unwrap_or_else(|| panic!("{path}: {body}"))
            .rsplit('/')
            .next()
            .unwrap();
        doc["components"]["schemas"][name].clone()
    }

    #[test]
    fn the_chat_body_is_the_request_and_its_sampling_fields() {
        let doc = doc();
        let chat = request_schema(&doc, "post", "/v1/chat/completions");
        let required: Vec<&str> = chat["required"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(required, ["model", "messages"]);
        let props = chat["properties"].as_object().unwrap();
        for field in [
            "messages",
            "cache_salt",
            "max_tokens",
            "max_completion_tokens",
            "response_format",
            "stop",
            "n",
            "logit_bias",
            "tools",
        ] {
            assert!(props.contains_key(field), "{field} missing: {chat}");
        }
        assert_eq!(props["messages"]["minItems"], 1);
        assert_eq!(props["max_tokens"]["minimum"], 1);
        assert_eq!(props["n"]["maximum"], openai::MAX_CHOICES);
        assert_eq!(props["top_logprobs"]["maximum"], openai::MAX_TOP_LOGPROBS);
        let completions = request_schema(&doc, "post", "/v1/completions");
        assert!(completions["properties"]["cache_salt"].is_object());
        assert!(completions["properties"]["prompt"]["oneOf"].is_array());
        assert_eq!(
            completions["properties"]["logprobs"]["maximum"],
            openai::MAX_COMPLETION_LOGPROBS
        );
        let messages = request_schema(&doc, "post", "/v1/messages");
        assert_eq!(
            messages["required"],
            json!(["model", "max_tokens", "messages"])
        );
        assert_eq!(
            request_schema(&doc, "post", "/detokenize")["required"],
            json!(["tokens"])
        );
        let tokenize = request_schema(&doc, "post", "/tokenize");
        let alternatives = &tokenize["allOf"][1]["oneOf"];
        assert_eq!(alternatives[0]["required"], json!(["prompt"]));
        assert_eq!(alternatives[1]["required"], json!(["messages"]));
    }

    #[test]
    fn the_responses_body_lists_what_its_field_check_lets_through() {
        let doc = doc();
        let schema = request_schema(&doc, "post", "/v1/responses");
        let props = schema["properties"].as_object().unwrap();
        for f in responses::FIELDS.iter().chain(&responses::IGNORED) {
            assert!(props.contains_key(*f), "{f} missing");
        }
        // Anything else is refused unless null.
        assert_eq!(schema["additionalProperties"], json!({"type": "null"}));
        for refused in ["n", "max_tokens", "max_completion_tokens"] {
            assert!(!props.contains_key(refused), "{refused}");
        }
        let items = &doc["components"]["schemas"]["ResponseInputItem"]["oneOf"];
        assert_eq!(items.as_array().unwrap().len(), 4);
        assert_eq!(
            items[1]["properties"]["type"]["enum"],
            json!(["function_call"])
        );
    }

    #[test]
    fn anthropic_blocks_are_the_served_types() {
        let doc = doc();
        let blocks = doc["components"]["schemas"]["AnthropicContentBlock"]["oneOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["properties"]["type"]["enum"][0].as_str().unwrap())
            .collect::<Vec<_>>();
        assert_eq!(blocks, ["text", "tool_use", "tool_result", "thinking"]);
    }

    /// The document's limits are the handlers': each bound of a sampling field is
    /// accepted, and a step past it refused naming the field.
    #[test]
    fn sampling_limits_are_the_ones_the_gateway_checks() {
        let doc = doc();
        let chat = request_schema(&doc, "post", "/v1/chat/completions");
        let sampling = SamplingFields::schema();
        let RefOr::T(Schema::Object(sampling)) = sampling else {
            panic!("an object");
        };
        let check = |field: &str, v: Value, ok: bool| {
            let body = json!({ field: v }).to_string();
            let got = openai::parse::<SamplingFields>(body.as_bytes()).and_then(|f| f.to_params());
            match (got, ok) {
                (Ok(_), true) => {}
                (Err(e), false) => assert_eq!(e.param.as_deref(), Some(field), "{body}"),
                (got, _) => panic!("{body}: {:?}", got.map(|_| ())),
            }
        };
        let mut checked = 0;
        for field in sampling.properties.keys() {
            let p = &chat["properties"][field];
            let integer = p["type"][0] == "integer";
            let step = if integer { json!(1) } else { json!(0.001) };
            let shift = |b: &Value, up: bool| {
                let (b, s) = (b.as_f64().unwrap(), step.as_f64().unwrap());
                let v = if up { b + s } else { b - s };
                if integer { json!(v as i64) } else { json!(v) }
            };
            if let Some(min) = p.get("minimum") {
                check(field, min.clone(), true);
                check(field, shift(min, false), false);
                checked += 1;
            }
            if let Some(min) = p.get("exclusiveMinimum") {
                check(field, min.clone(), false);
                check(field, shift(min, true), true);
                checked += 1;
            }
            if let Some(max) = p.get("maximum") {
                check(field, max.clone(), true);
                check(field, shift(max, true), false);
                checked += 1;
            }
        }
        assert!(checked >= 15, "only {checked} bounds checked");
        for (field, longest) in [
            ("cache_salt", openai::MAX_CACHE_SALT_BYTES),
            ("stop", openai::MAX_STOP_BYTES),
        ] {
            check(field, json!("é".repeat(longest / 2)), true);
            check(field, json!("x".repeat(longest + 1)), false);
            check(field, json!(""), false);
        }
        check("stop", json!(vec!["a"; openai::MAX_STOP]), true);
        check("stop", json!(vec!["a"; openai::MAX_STOP + 1]), false);
        check("logit_bias", json!({"0": -100, "999999999": 100}), true);
        check("logit_bias", json!({"x": 1}), false);
    }
}
