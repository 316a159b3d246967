//! The payment provider's client: `POST /v1/charges` with the attempt's key, and the lookup by
//! key (`GET /v1/charges?idempotency_key=`), each bounded by `ORDERS_PSP_TIMEOUT_MS`.
//!
//! What a call means is decided here, once: only the provider's 503 and a connection that was
//! never made say "not executed"; a timeout, a connection lost after sending, the provider's own
//! 409 (the same key still in flight there) and any answer this client cannot read are
//! **unknown**: the charge may have happened.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Uri;
use hyper::header::CONTENT_TYPE;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

/// A charge as the provider shows it.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct Charge {
    pub(crate) charge_id: String,
    pub(crate) status: String,
}

impl Charge {
    /// Whether the provider declined it.
    pub(crate) fn declined(&self) -> bool {
        self.status == "declined"
    }
}

/// What one charge call found.
#[derive(Debug)]
pub(crate) enum Charged {
    /// The provider answered with the charge (succeeded or declined).
    Done(Charge),
    /// The provider said it did not execute (its 503), or the connection was never made.
    NotExecuted,
    /// Nobody knows whether the charge happened.
    Unknown(String),
}

/// What the lookup by key found.
#[derive(Debug)]
pub(crate) enum Looked {
    /// The charge made with the key.
    Found(Charge),
    /// The provider has no charge with the key.
    None,
    /// The lookup failed (timed out, refused, unreadable): no evidence either way.
    Failed(String),
}

/// The provider at `base`.
#[derive(Clone)]
pub(crate) struct Provider {
    base: String,
    timeout: Duration,
    client: Client<HttpConnector, Full<Bytes>>,
}

#[derive(Deserialize)]
struct Charges {
    charges: Vec<Charge>,
}

impl Provider {
    /// A client of the provider at `base` (its scheme and authority), each call bounded by
    /// `timeout`.
    pub(crate) fn new(base: &Uri, timeout: Duration) -> Self {
        let base = base.to_string().trim_end_matches('/').to_owned();
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(connector);
        Self { base, timeout, client }
    }

    /// Charges `amount_minor` (digits) in `currency` for `reference`, with `key`.
    pub(crate) async fn charge(&self, key: &str, amount_minor: &str, currency: &str, reference: &str) -> Charged {
        let body = format!(
            "{{\"amount_minor\":{amount_minor},\"currency\":{},\"reference\":{}}}",
            serde_json::Value::from(currency),
            serde_json::Value::from(reference)
        );
        let request = hyper::Request::post(format!("{}/v1/charges", self.base))
            .header(CONTENT_TYPE, "application/json")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(body)));
        let Ok(request) = request else {
            return Charged::Unknown("the charge request could not be built".to_owned());
        };
        match self.exchange(request).await {
            Err(Exchange::NotConnected(error)) => Charged::NotExecuted.log(&error),
            Err(Exchange::Lost(error)) => Charged::Unknown(error),
            Ok((503, _)) => Charged::NotExecuted,
            Ok((201, body)) => match serde_json::from_slice::<Charge>(&body) {
                Ok(charge) => Charged::Done(charge),
                Err(error) => Charged::Unknown(format!("an unreadable charge: {error}")),
            },
            Ok((status, _)) => Charged::Unknown(format!("the provider answered {status}")),
        }
    }

    /// The charge made with `key`, if any.
    pub(crate) async fn lookup(&self, key: &str) -> Looked {
        // Downstream keys are hex: nothing to escape.
        let request = hyper::Request::get(format!("{}/v1/charges?idempotency_key={key}", self.base))
            .body(Full::new(Bytes::new()));
        let Ok(request) = request else {
            return Looked::Failed("the lookup could not be built".to_owned());
        };
        match self.exchange(request).await {
            Err(Exchange::NotConnected(error) | Exchange::Lost(error)) => Looked::Failed(error),
            Ok((200, body)) => match serde_json::from_slice::<Charges>(&body) {
                Ok(found) => found.charges.into_iter().next().map_or(Looked::None, Looked::Found),
                Err(error) => Looked::Failed(format!("an unreadable lookup: {error}")),
            },
            Ok((status, _)) => Looked::Failed(format!("the lookup answered {status}")),
        }
    }

    /// Sends `request` and reads the whole answer within the timeout.
    async fn exchange(&self, request: hyper::Request<Full<Bytes>>) -> Result<(u16, Bytes), Exchange> {
        let call = async {
            let response = self.client.request(request).await.map_err(|error| {
                if error.is_connect() {
                    Exchange::NotConnected(error.to_string())
                } else {
                    Exchange::Lost(error.to_string())
                }
            })?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await.map_err(|error| Exchange::Lost(error.to_string()))?;
            Ok((status, body.to_bytes()))
        };
        tokio::time::timeout(self.timeout, call).await.unwrap_or_else(|_| Err(Exchange::Lost("timed out".to_owned())))
    }
}

/// Why an exchange has no answer.
enum Exchange {
    /// No connection was made: nothing was sent.
    NotConnected(String),
    /// Sent (or perhaps sent), answer lost.
    Lost(String),
}

impl Charged {
    fn log(self, error: &str) -> Self {
        eprintln!("orders: the payment provider could not be reached: {error}");
        self
    }
}
