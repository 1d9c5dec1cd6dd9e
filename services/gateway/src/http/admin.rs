//! The operators' routes (`/debug/incidents`): the incident reports this gateway wrote.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::state::AppState;

fn incident_dir(st: &AppState) -> Result<&std::path::Path, ApiError> {
    st.incidents.as_ref().map(|r| r.dir()).ok_or_else(|| {
        ApiError::not_found("incident reports are off: start the gateway with --incident-dir")
    })
}

fn incident_error(e: pdmesh_incident::Error) -> ApiError {
    match e {
        pdmesh_incident::Error::NotFound(_) | pdmesh_incident::Error::BadId(_) => {
            ApiError::not_found(e.to_string())
        }
        e => ApiError::backend(e.to_string()),
    }
}

/// The incident reports.
///
/// The reports in `--incident-dir`, newest first, summarized (404 without the flag).
#[utoipa::path(
    get,
    path = "/debug/incidents",
    tag = "Admin",
    responses(
        (status = 200, description = "`{\"object\": \"list\", \"data\": [...]}`, a summary per report.", body = Object),
        crate::api::schema::AdminErrors,
    ),
    security(("admin" = [])),
)]
pub(crate) async fn list_incidents(State(st): State<AppState>) -> Result<Json<Value>, ApiError> {
    let dir = incident_dir(&st)?.to_owned();
    let all = tokio::task::spawn_blocking(move || pdmesh_incident::list(&dir))
        .await
        .map_err(|e| ApiError::backend(format!("listing incidents: {e}")))?
        .map_err(incident_error)?;
    let data: Vec<Value> = all
        .iter()
        .map(|i| {
            json!({
                "id": i.id,
                "kind": i.kind.name(),
                "title": i.kind.title(),
                "summary": i.summary,
                "first_seen": i.first_seen,
                "last_seen": i.last_seen,
                "repeats": i.repeats,
                "service": i.place.service,
                "request_id": i.place.request_id,
                "trace_id": i.place.trace_id,
            })
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

#[derive(serde::Deserialize)]
pub(crate) struct IncidentQuery {
    format: Option<String>,
}

/// An incident report.
///
/// A report as JSON, or as Markdown with `?format=markdown`.
#[utoipa::path(
    get,
    path = "/debug/incidents/{id}",
    tag = "Admin",
    params(
        ("id" = String, Path, description = "The report's id."),
        ("format" = Option<String>, Query, description = "`json` (the default), `markdown` or `md`."),
    ),
    responses(
        (status = 200, description = "The report.", content(
            (Object = "application/json"),
            (String = "text/markdown"),
        )),
        crate::api::schema::AdminErrors,
    ),
    security(("admin" = [])),
)]
pub(crate) async fn get_incident(
    State(st): State<AppState>,
    Path(id): Path<String>,
    axum::extract::Query(q): axum::extract::Query<IncidentQuery>,
) -> Result<Response, ApiError> {
    let dir = incident_dir(&st)?.to_owned();
    let i = tokio::task::spawn_blocking(move || pdmesh_incident::read(&dir, &id))
        .await
        .map_err(|e| ApiError::backend(format!("reading an incident: {e}")))?
        .map_err(incident_error)?;
    Ok(match q.format.as_deref() {
        None | Some("json") => Json(serde_json::to_value(&i).unwrap_or_default()).into_response(),
        Some("markdown" | "md") => (
            [(header::CONTENT_TYPE, "text/markdown; charset=utf-8")],
            pdmesh_incident::render(&i),
        )
            .into_response(),
        Some(other) => {
            return Err(ApiError::invalid_param(
                "format",
                format!("format is json or markdown, not {other:?}"),
            ));
        }
    })
}
