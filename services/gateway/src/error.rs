//! The gateway's two error boundaries: [`Error`] stops the server from starting or
//! serving, [`ApiError`] answers one request with an OpenAI-shaped error body. Every
//! request error is classified once, here, into an HTTP status and a metric label.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Why the gateway could not start or keep serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("invalid backend URL {url:?}")]
    BackendUrl {
        url: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("metrics registry")]
    Metrics(#[from] prometheus::Error),
    #[error("HTTP server")]
    Serve(#[source] std::io::Error),
}

/// A request that failed: rendered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    pub message: String,
    /// The metric label (`mesh_errors_total{error_type}`).
    pub error_type: ErrorType,
}

pdmesh_telemetry::label_set! {
    /// Classes of request errors (`mesh_errors_total{error_type}`).
    pub(crate) enum ErrorType {
        InvalidRequest => "invalid_request",
        ContextLengthExceeded => "context_length_exceeded",
        ModelNotFound => "model_not_found",
        NotFound => "not_found",
        Authentication => "authentication",
        PayloadTooLarge => "payload_too_large",
        BackendUnavailable => "backend_unavailable",
        BackendError => "backend_error",
        UnparsableOutput => "unparsable_output",
        Aborted => "aborted",
        Overloaded => "overloaded",
        Timeout => "timeout",
    }
}

/// Marker put in the extensions of an error response so the metrics middleware can count
/// it by class without parsing the body.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ErrorClass(pub ErrorType);

impl ApiError {
    /// A 400 about the request as a whole or about `param`.
    pub fn invalid_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            param: param.map(str::to_owned),
            message: message.into(),
            error_type: ErrorType::InvalidRequest,
        }
    }

    /// A 400 naming the parameter that is out of range.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self {
            code: Some("invalid_value"),
            ..Self::invalid_request(message, Some(param))
        }
    }

    /// A 400 for a feature this server does not implement.
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        Self {
            code: Some("unsupported_parameter"),
            ..Self::invalid_request(message, Some(param))
        }
    }

    pub fn context_length(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            code: Some("context_length_exceeded"),
            error_type: ErrorType::ContextLengthExceeded,
            ..Self::invalid_request(message, param)
        }
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: Some("model_not_found"),
            param: Some("model".into()),
            message: format!("The model `{model}` does not exist."),
            error_type: ErrorType::ModelNotFound,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: Some("not_found"),
            param: None,
            message: message.into(),
            error_type: ErrorType::NotFound,
        }
    }

    pub fn method_not_allowed() -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            kind: "invalid_request_error",
            code: Some("method_not_allowed"),
            param: None,
            message: "method not allowed for this endpoint".into(),
            error_type: ErrorType::InvalidRequest,
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            code: Some("invalid_api_key"),
            param: None,
            message: message.into(),
            error_type: ErrorType::Authentication,
        }
    }

    /// A 403: the route is closed to every caller (no key could open it).
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::FORBIDDEN,
            kind: "permission_error",
            code: Some("forbidden"),
            param: None,
            message: message.into(),
            error_type: ErrorType::Authentication,
        }
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            code: Some("request_too_large"),
            param: None,
            message: format!("the request body is larger than the limit of {limit} bytes"),
            error_type: ErrorType::PayloadTooLarge,
        }
    }

    /// A backend could not be reached (503).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: Some("service_unavailable"),
            param: None,
            message: message.into(),
            error_type: ErrorType::BackendUnavailable,
        }
    }

    /// The gateway already serves its `--max-concurrent-requests` (503, `Retry-After`).
    pub fn shed(limit: usize) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: Some("overloaded"),
            param: None,
            message: format!(
                "the gateway is serving its limit of {limit} concurrent requests; retry later"
            ),
            error_type: ErrorType::Overloaded,
        }
    }

    /// A backend answered something it should not have (500).
    pub fn backend(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: None,
            param: None,
            message: message.into(),
            error_type: ErrorType::BackendError,
        }
    }

    /// The model wrote a tool call or reasoning block that does not parse (500): failing
    /// closed, so the markup is never returned as content.
    pub fn unparsable_output(parser: &str, reason: &str, detail: &str) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: Some("model_output_unparsable"),
            param: None,
            message: format!("the model's output failed to parse as {parser} ({reason}): {detail}"),
            error_type: ErrorType::UnparsableOutput,
        }
    }

    /// The worker aborted the request (for example while shutting down).
    pub fn aborted() -> Self {
        Self {
            error_type: ErrorType::Aborted,
            code: Some("aborted"),
            ..Self::unavailable("the request was aborted by the worker before it finished")
        }
    }

    /// The JSON body, as the HTTP body and as a mid-stream SSE `data:` payload.
    pub fn body(&self) -> serde_json::Value {
        json!(ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        })
    }
}

/// The body of every error answer (and of an error sent in the middle of a stream), as
/// OpenAI's API writes it.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ErrorBody<'a> {
    pub error: ErrorObject<'a>,
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ErrorObject<'a> {
    /// What went wrong, for a person; names the field at fault.
    pub message: &'a str,
    /// The class of error: `invalid_request_error`, `authentication_error`,
    /// `permission_error`, `rate_limit_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// The request field at fault (`messages[0].role`, `max_tokens`), or null when the
    /// error is not about one field.
    #[schema(required = true)]
    pub param: Option<&'a str>,
    /// A machine-readable code (`invalid_value`, `model_not_found`,
    /// `context_length_exceeded`, `overloaded`, ...), or null.
    #[schema(required = true)]
    pub code: Option<&'a str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        resp.extensions_mut().insert(ErrorClass(self.error_type));
        if self.error_type == ErrorType::Overloaded {
            // Overloaded, not broken: a client may come back after this many seconds.
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        resp
    }
}

/// The `Retry-After` of a shed or refused-for-load request, in seconds.
pub(crate) const RETRY_AFTER_SECS: &str = "1";

/// The `code` of an error whose cause is corrupt KV (gRPC's DATA_LOSS).
pub(crate) const DATA_LOSS: &str = "data_loss";

impl From<tonic::Status> for ApiError {
    /// The one place gRPC errors become HTTP errors: the backend's message is kept for
    /// client errors, because it names the field that is wrong. Only the codes that blame
    /// the request (a backend's own validation of it: INVALID_ARGUMENT, OUT_OF_RANGE,
    /// FAILED_PRECONDITION) are 4xx, and RESOURCE_EXHAUSTED, the mesh's "overloaded, try
    /// again" (429); everything else is the mesh's fault, a 5xx. Backends keep their own
    /// failures out of those codes (a worker re-classifies its cache service's).
    fn from(status: tonic::Status) -> Self {
        use tonic::Code;
        let msg = status.message().to_owned();
        match status.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                if pdmesh_proto::error_kind::of(&status).as_deref()
                    == Some(pdmesh_proto::error_kind::CONTEXT_LENGTH)
                {
                    Self::context_length(msg, None)
                } else {
                    Self::invalid_request(msg, None)
                }
            }
            // Aborted: a KV transfer's room failed (a peer left, a deadline passed).
            Code::Unavailable | Code::Cancelled | Code::Aborted => {
                Self::unavailable(format!("backend unavailable: {msg}"))
            }
            Code::ResourceExhausted => Self {
                status: StatusCode::TOO_MANY_REQUESTS,
                kind: "rate_limit_error",
                code: Some("overloaded"),
                param: None,
                message: msg,
                error_type: ErrorType::Overloaded,
            },
            Code::DeadlineExceeded => Self {
                status: StatusCode::GATEWAY_TIMEOUT,
                error_type: ErrorType::Timeout,
                ..Self::backend(format!("backend timed out: {msg}"))
            },
            // A backend's NOT_FOUND names something of its own (a room, a lease, a
            // request id), never what the client asked for: the gateway answers those
            // 404s itself.
            // Corrupt KV: the request fails, and an incident report says why.
            Code::DataLoss => Self {
                code: Some(DATA_LOSS),
                ..Self::backend(format!("backend error (DataLoss): {msg}"))
            },
            // A status the transport made up (it carries its cause; one a backend sent has
            // none): the connection to the backend broke mid-call, a worker that died or
            // a link that went down. The mesh's fault, and another try may find a worker.
            _ if pdmesh_proto::error_kind::connection_lost(&status) => Self::unavailable(format!(
                "backend unavailable: the connection to it was lost ({msg})"
            )),
            code => Self::backend(format!("backend error ({code:?}): {msg}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_lost_mid_call_is_unavailable_and_a_backends_own_error_is_not() {
        let lost = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        )));
        let e = ApiError::from(lost);
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE, "{}", e.message);
        assert!(
            e.message.contains("connection to it was lost"),
            "{}",
            e.message
        );
        // The same code as a backend's answer (no cause attached) stays a 500.
        let sent = ApiError::from(tonic::Status::unknown("engine said no"));
        assert_eq!(sent.status, StatusCode::INTERNAL_SERVER_ERROR);
        let sent = ApiError::from(tonic::Status::internal("engine said no"));
        assert_eq!(sent.status, StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn grpc_invalid_argument_keeps_the_backend_message_as_a_400() {
        let e = ApiError::from(tonic::Status::invalid_argument(
            "messages[1].content is not valid UTF-8",
        ));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            e.body()["error"]["message"],
            "messages[1].content is not valid UTF-8"
        );
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn grpc_context_errors_carry_the_openai_code() {
        let e = ApiError::from(pdmesh_proto::error_kind::status(
            tonic::Code::InvalidArgument,
            "the prompt has 9000 tokens; this model's context length is 8192",
            pdmesh_proto::error_kind::CONTEXT_LENGTH,
        ));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
        // The kind decides, not the words.
        let e = ApiError::from(tonic::Status::invalid_argument(
            "the prompt is longer than the context length",
        ));
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        assert!(e.body()["error"]["code"].is_null());
    }

    #[test]
    fn grpc_unavailable_is_503_and_unknown_codes_are_500() {
        assert_eq!(
            ApiError::from(tonic::Status::unavailable("tcp connect error")).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            ApiError::from(tonic::Status::internal("boom")).status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn an_overloaded_answer_says_when_to_come_back() {
        for e in [
            ApiError::from(tonic::Status::resource_exhausted(
                "the engine's queue is full",
            )),
            ApiError::shed(4),
        ] {
            let resp = e.clone().into_response();
            assert_eq!(
                resp.headers().get("retry-after").map(|v| v.as_bytes()),
                Some(RETRY_AFTER_SECS.as_bytes()),
                "{e:?}"
            );
            assert_eq!(e.code, Some("overloaded"));
        }
        assert_eq!(ApiError::shed(4).status, StatusCode::SERVICE_UNAVAILABLE);
        let other = ApiError::unavailable("a worker is down").into_response();
        assert!(other.headers().get("retry-after").is_none());
    }

    #[test]
    fn every_grpc_code_a_backend_answers_with_has_one_http_status() {
        use tonic::Code::*;
        let table = [
            (Ok, 500),
            (Cancelled, 503),
            (Unknown, 500),
            (InvalidArgument, 400),
            (DeadlineExceeded, 504),
            (NotFound, 500),
            (AlreadyExists, 500),
            (PermissionDenied, 500),
            (ResourceExhausted, 429),
            (FailedPrecondition, 400),
            (Aborted, 503),
            (OutOfRange, 400),
            (Unimplemented, 500),
            (Internal, 500),
            (Unavailable, 503),
            (DataLoss, 500),
            (Unauthenticated, 500),
        ];
        assert_eq!(table.len(), 17, "every gRPC code");
        for (code, want) in table {
            let e = ApiError::from(tonic::Status::new(code, "the backend's words"));
            assert_eq!(e.status.as_u16(), want, "{code:?}");
            assert!(e.message.contains("the backend's words"), "{code:?}: {e:?}");
            // A client error names the request; a server error is the mesh's.
            let kind = if want == 429 {
                "rate_limit_error"
            } else if want < 500 {
                "invalid_request_error"
            } else {
                "server_error"
            };
            assert_eq!(e.kind, kind, "{code:?}");
        }
    }

    #[test]
    fn error_body_has_all_four_fields_even_when_null() {
        let body = ApiError::invalid_request("bad", None).body();
        let obj = body["error"].as_object().unwrap();
        for k in ["message", "type", "param", "code"] {
            assert!(obj.contains_key(k), "missing {k}");
        }
        assert!(obj["param"].is_null());
    }
}
