//! What the replay asks the server besides generation: the served model (`GET /v1/models`) and its counters
//! (`GET /metrics`, scraped before and after the profiling phase).
//!
//! Invariants:
//! - Every request carries the run's API key, as the generation requests do.
//! - The served model is the single `id` `GET /v1/models` lists; a list of several (and no `--model`) is an
//!   error naming them, never a guess.
//! - A scrape that fails (no `/metrics`, a body that is not the text format) is an `Err` the caller records in
//!   the report: the run itself does not depend on it.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use crate::error::{ReplayError, Result};
use crate::prometheus::Scrape;
use crate::transport::{bearer, http_authority};

/// A small GET client for one server.
#[derive(Clone)]
pub struct ServerClient {
    client: Client<HttpConnector, Empty<Bytes>>,
    authority: String,
    authorization: Option<hyper::header::HeaderValue>,
}

impl ServerClient {
    /// `base_url` is `http://host:port`; `api_key` is sent as a bearer token.
    pub fn new(base_url: &str, api_key: Option<&str>) -> Result<Self> {
        let authority = http_authority(base_url)?;
        let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        Ok(ServerClient { client, authority, authorization: bearer(api_key)? })
    }

    /// `GET path`: the status and the body as text.
    async fn get(&self, path: &str) -> Result<(u16, String)> {
        let uri: hyper::Uri = format!("http://{}{path}", self.authority)
            .parse()
            .map_err(|e| ReplayError::option("--url", format!("{e}")))?;
        let mut req = hyper::Request::get(uri);
        if let Some(auth) = &self.authorization {
            req = req.header("authorization", auth);
        }
        let req = req.body(Empty::new()).map_err(|e| ReplayError::Protocol(e.to_string()))?;
        let response = self
            .client
            .request(req)
            .await
            .map_err(|e| ReplayError::Connection(format!("GET {path} on {}: {e}", self.authority)))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| ReplayError::Connection(format!("GET {path}: {e}")))?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    /// The one model the server serves, for runs that do not name one with `--model`.
    pub async fn served_model(&self) -> Result<String> {
        let (status, body) = self.get("/v1/models").await?;
        if !(200..300).contains(&status) {
            return Err(ReplayError::option(
                "--model",
                format!("not given, and GET /v1/models answered {status}: {body:.200}; name the model with --model"),
            ));
        }
        single_model(&body)
    }

    /// The server's metrics now.
    pub async fn scrape(&self) -> Result<Scrape> {
        let (status, body) = self.get("/metrics").await?;
        if !(200..300).contains(&status) {
            return Err(ReplayError::Server { status, body: format!("GET /metrics: {body:.200}") });
        }
        Scrape::parse("GET /metrics", &body)
    }
}

/// The single model id of a `GET /v1/models` answer (`{"data": [{"id": ...}, ...]}`).
pub fn single_model(body: &str) -> Result<String> {
    let value: serde_json::Value = serde_json::from_str(body)
        .map_err(|e| ReplayError::Protocol(format!("GET /v1/models: not JSON ({e}): {body:.200}")))?;
    let data = value
        .get("data")
        .and_then(|d| d.as_array())
        .ok_or_else(|| ReplayError::Protocol(format!("GET /v1/models: no `data` list of models: {body:.200}")))?;
    let ids = data
        .iter()
        .map(|m| m.get("id").and_then(|i| i.as_str()).map(str::to_owned))
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| ReplayError::Protocol(format!("GET /v1/models: a model without a string `id`: {body:.200}")))?;
    match ids.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(ReplayError::option("--model", "not given, and GET /v1/models lists no model")),
        several => Err(ReplayError::option(
            "--model",
            format!("not given, and the server serves several models ({}): pick one with --model", several.join(", ")),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_single_listed_model_is_chosen_and_anything_else_is_a_clear_error() {
        let one = r#"{"object":"list","data":[{"id":"k3-tiny","object":"model","owned_by":"sparkd"}]}"#;
        assert_eq!(single_model(one).unwrap(), "k3-tiny");
        let two = r#"{"data":[{"id":"a"},{"id":"b"}]}"#;
        let err = single_model(two).unwrap_err();
        assert_eq!(err.kind(), "option");
        assert!(err.to_string().contains("several models (a, b): pick one with --model"), "{err}");
        assert!(single_model(r#"{"data":[]}"#).unwrap_err().to_string().contains("lists no model"));
        assert_eq!(single_model("not json").unwrap_err().kind(), "protocol");
        assert!(single_model(r#"{"data":[{"name":"x"}]}"#).unwrap_err().to_string().contains("string `id`"));
    }
}
