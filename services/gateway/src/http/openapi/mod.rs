//! The gateway's OpenAPI 3.1 document, served at `GET /openapi.json`: every route, its
//! request body (derived from the types the handlers deserialize, with the limits the
//! handlers check), the API-key security scheme and the error answers.
//!
//! The request types derive `utoipa::ToSchema`; what a derive cannot say is written beside
//! each type from the same constants (the chat and completions bodies, one object with the
//! sampling fields, in `api::openai::request`; the Responses body in
//! `api::responses::request`). Here: the paths, the security schemes and the error answers.

use std::sync::LazyLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{
    ContentBuilder, HeaderBuilder, OpenApi as Document, Ref, RefOr, ResponseBuilder,
};
use utoipa::{Modify, OpenApi};

use crate::api::anthropic::AnthropicErrorBody;
use crate::error::ErrorBody;

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
        crate::api::openai::chat_completions,
        crate::api::openai::completions,
        crate::api::anthropic::messages,
        crate::api::responses::create,
        crate::api::responses::get,
        crate::api::responses::delete,
        crate::api::openai::list_models,
        crate::api::openai::get_model,
        crate::http::tokens::tokenize,
        crate::http::tokens::detokenize,
        crate::http::tokens::flush_cache,
        crate::http::ops::health,
        crate::http::ops::ready,
        crate::http::ops::live,
        crate::http::ops::metrics,
        openapi_json,
        crate::http::admin::list_incidents,
        crate::http::admin::get_incident,
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
mod tests;
