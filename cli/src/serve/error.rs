//! OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the HTTP status
//! OpenAI (and llama.cpp's server) answer with.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A request the server refuses or could not complete. Every variant becomes one JSON error
/// object; nothing else happens on the server.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 400: the request is wrong (names `param` where one field is to blame).
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> ApiError {
        ApiError {
            param: param.map(str::to_string),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// 404 with code `model_not_found`, as OpenAI answers an unknown model.
    pub fn unknown_model(found: &str, served: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{found}` does not exist; this server serves `{served}`"),
            )
        }
    }

    /// 413: the body is over the server's limit.
    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is over the limit of {limit} bytes"),
        )
        .with_code("request_too_large")
    }

    /// 429: the queue of waiting requests is full.
    pub fn queue_full(capacity: usize) -> ApiError {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("the server's queue is full ({capacity} requests waiting); retry later"),
        )
        .with_code("queue_full")
    }

    /// 503: the model is not loaded yet, or the engine has stopped.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            message,
        )
    }

    /// 500: the generation failed on the server's side.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// 404 for a path this server does not have.
    pub fn no_route(method: &str, path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route {method} {path}; this server has /v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics"),
        )
    }

    /// 408: the body did not arrive in time.
    pub fn body_timeout(secs: u64) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("the request body did not arrive within {secs} s"),
        )
    }

    /// The error object (also sent as an SSE event when a stream fails midway).
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
