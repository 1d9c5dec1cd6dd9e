//! The key checks: `--api-key` on the API routes, `--admin-key` on `/debug/*`, compared in
//! constant time.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::AppState;

/// Constant-time comparison, so the key cannot be guessed byte by byte from timings.
fn same_key(given: &[u8], expected: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(given, expected).into()
}

/// The key in an `Authorization: Bearer <key>` header, if there is one.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    v.strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
}

/// `/debug/*` requires `Authorization: Bearer <admin key>`: 403 when the gateway has no
/// `--admin-key` (nobody may read them), 401 when the key is missing or wrong. The API
/// key opens nothing here.
pub(super) async fn admin_auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = &st.cfg.admin_key else {
        return ApiError::forbidden(
            "The operators' routes are closed: start the gateway with --admin-key (PDMESH_ADMIN_KEY) to open them.",
        )
        .into_response();
    };
    match bearer(req.headers()) {
        None => ApiError::unauthorized(
            "You didn't provide the admin key. Send it in an `Authorization: Bearer <key>` header.",
        )
        .into_response(),
        Some(k) if !same_key(k.trim().as_bytes(), key.as_bytes()) => {
            ApiError::unauthorized("Incorrect admin key provided.").into_response()
        }
        Some(_) => next.run(req).await,
    }
}

/// With `--api-key`, `/v1/*` requires `Authorization: Bearer <key>` (or `x-api-key`).
pub(super) async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let given = bearer(req.headers())
            // Anthropic's clients send the key as `x-api-key`.
            .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
        match given {
            None => {
                return ApiError::unauthorized(
                    "You didn't provide an API key. Send it in an `Authorization: Bearer <key>` header.",
                )
                .into_response();
            }
            Some(k) if !same_key(k.trim().as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("Incorrect API key provided.").into_response();
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_key_comparison() {
        assert!(same_key(b"abc", b"abc"));
        assert!(!same_key(b"abd", b"abc"));
        assert!(!same_key(b"ab", b"abc"));
    }
}
