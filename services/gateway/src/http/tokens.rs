//! vLLM's `/tokenize` and `/detokenize` and SGLang's `/flush_cache`: routes on the tokenizer
//! and the workers' caches that no protocol module owns.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use serde_json::{Value, json};

use crate::api::handler::body_bytes;
use crate::api::openai::request::{DetokenizeRequest, ToTokenize, TokenizeRequest};
use crate::error::ApiError;
use crate::json;
use crate::state::AppState;

/// Empties the workers' prefix caches.
///
/// SGLang's route: every worker evicts the pages of its device prefix cache that no
/// request uses. 200 with the pages each worker freed; 503 naming the workers that did
/// not flush (the others still did).
#[utoipa::path(
    post,
    path = "/flush_cache",
    tag = "Tokens",
    responses(
        (status = 200, description = "`{\"pages_flushed\", \"workers\": [{\"role\", \"url\", \"pages_flushed\"}]}`.", body = Object),
        crate::api::schema::BackendErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn flush_cache(State(st): State<AppState>) -> Result<Json<Value>, ApiError> {
    let flushed = st.backends.flush_cache().await;
    let failed: Vec<String> = flushed
        .iter()
        .filter_map(|f| match &f.pages {
            Err(why) => Some(format!(
                "the {} worker {}: {}",
                f.role.as_str(),
                f.url,
                why.message
            )),
            Ok(_) => None,
        })
        .collect();
    let total: u64 = flushed.iter().filter_map(|f| f.pages.as_ref().ok()).sum();
    if !failed.is_empty() {
        return Err(ApiError::unavailable(format!(
            "the cache flush failed on {} (the other workers flushed {total} pages)",
            failed.join("; ")
        )));
    }
    tracing::info!(pages = total, "flushed every worker's device prefix cache");
    let workers: Vec<Value> = flushed
        .iter()
        .map(|f| json!({ "role": f.role.as_str(), "url": f.url, "pages_flushed": f.pages.as_ref().ok() }))
        .collect();
    Ok(Json(json!({ "pages_flushed": total, "workers": workers })))
}

/// Tokenizes a prompt or chat messages.
///
/// As vLLM serves it: a prompt, or chat messages through the chat template (the ids a
/// chat request with them would run).
#[utoipa::path(
    post,
    path = "/tokenize",
    tag = "Tokens",
    request_body = crate::api::openai::request::TokenizeBody,
    responses(
        (status = 200, description = "`{\"count\", \"max_model_len\", \"tokens\", \"token_strs\"}`.", body = Object),
        crate::api::schema::TokenizeErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn tokenize(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body = body_bytes(&st, body)?;
    let req: TokenizeRequest = json::parse(&body)?;
    if let Some(m) = &req.model {
        st.check_model(m).await?;
    }
    let ids = match req.input()? {
        ToTokenize::Prompt { text, add_special } => st.backends.tokenize(text, add_special).await?,
        ToTokenize::Chat {
            messages,
            tools_json,
        } => {
            st.backends
                .apply_chat_template(messages, tools_json, false)
                .await?
        }
    };
    let info = st.worker_info().await?;
    Ok(Json(json!({
        "count": ids.len(),
        "max_model_len": info.context_length,
        "tokens": ids,
        "token_strs": null,
    })))
}

/// The text of token ids.
///
/// As vLLM serves it: the text of token ids, special tokens included.
#[utoipa::path(
    post,
    path = "/detokenize",
    tag = "Tokens",
    request_body = DetokenizeRequest,
    responses(
        (status = 200, description = "`{\"prompt\": text}`.", body = Object),
        crate::api::schema::TokenizeErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn detokenize(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body = body_bytes(&st, body)?;
    let req: DetokenizeRequest = json::parse(&body)?;
    if let Some(m) = &req.model {
        st.check_model(m).await?;
    }
    let vocab = st.worker_info().await?.vocab_size;
    if let Some((i, t)) = req
        .tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| vocab > 0 && t >= vocab)
    {
        return Err(ApiError::invalid_param(
            "tokens",
            format!("tokens[{i}]: token id {t} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    let text = match st.local_tokenizer().await {
        Some(tok) => tok
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::invalid_param("tokens", e.to_string()))?,
        None => st.backends.detokenize(req.tokens).await?,
    };
    Ok(Json(json!({ "prompt": text })))
}
