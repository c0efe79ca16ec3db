//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with the
//! status that names what went wrong. Every bad request ends here as a value; nothing the
//! client sends can panic the server.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use ferrolm::serving::SubmitError;
use serde_json::json;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: invalid_request_error, rate_limit_error, server_error.
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    /// 400 for a request whose field `param` is wrong.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param), ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    /// 400 that names no single field (malformed JSON, a prompt too long for the context).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError { code: Some("not_found"), ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message) }
    }

    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "this method is not allowed on this route")
    }

    /// The status a body-reading failure chose (413 past the size limit, 400 otherwise).
    pub fn body(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, "invalid_request_error", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError { code: Some("unavailable"), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message) }
    }

    /// The request ran past the server's request timeout.
    pub fn timeout(message: impl Into<String>) -> Self {
        ApiError { code: Some("timeout"), ..Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message) }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body, also sent as an SSE event when a stream fails after it started.
    pub fn body_json(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        let message = e.to_string();
        match e {
            SubmitError::Busy { retry_after } => ApiError {
                code: Some("rate_limit_exceeded"),
                retry_after: Some(retry_after.as_secs().max(1)),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            },
            SubmitError::Invalid(_) => Self::bad_request(message),
            SubmitError::Closed => Self::unavailable(message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r =
            (self.status, [(header::CONTENT_TYPE, "application/json")], self.body_json().to_string()).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// A client's value quoted in an error message: control characters escaped, and at most
/// 64 characters of it (a megabyte-long role is not sent back whole).
pub fn quote(value: &str) -> String {
    const MAX: usize = 64;
    let cut: String = value.chars().take(MAX).collect();
    let more = if value.chars().nth(MAX).is_some() { "…" } else { "" };
    format!("\"{}{more}\"", ferrolm::files::printable(&cut))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_values_are_escaped_and_cut() {
        assert_eq!(quote("a\nb\u{1b}"), "\"a\\nb\\u{1b}\"");
        let long = "x".repeat(100);
        assert_eq!(quote(&long), format!("\"{}…\"", "x".repeat(64)));
    }

    #[test]
    fn busy_is_429_with_retry_after() {
        let e = ApiError::from(SubmitError::Busy { retry_after: std::time::Duration::from_millis(300) });
        assert_eq!((e.status, e.retry_after), (StatusCode::TOO_MANY_REQUESTS, Some(1)));
        let r = e.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert_eq!(ApiError::from(SubmitError::Closed).status, StatusCode::SERVICE_UNAVAILABLE);
    }
}
