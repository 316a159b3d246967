//! [`WebhookSender`]: delivers events as signed `POST`s over hyper-util's pooled client.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connect, HttpConnector};
use hyper_util::rt::TokioExecutor;

use super::{SIGNATURE_HEADER, TIMESTAMP_HEADER, WEBHOOK_ID_HEADER, WebhookSecret};
use crate::outbox::{PendingEvent, SendError, Sender};

/// How much of a receiver's answer is read (and thrown away), so the connection can be reused.
const ANSWER_LIMIT: usize = 64 * 1024;

/// A [`Sender`] that `POST`s each event to one URL as a Standard Webhook: the event's body as
/// enqueued (`content-type: application/json`), `webhook-id` (the event id),
/// `webhook-timestamp` (this attempt's time) and `webhook-signature`. A 2xx is a delivery;
/// anything else, or a transport error, is retried by the relay.
#[derive(Clone, Debug)]
pub struct WebhookSender<C = HttpConnector> {
    client: Client<C, Full<Bytes>>,
    url: Uri,
    secret: WebhookSecret,
}

impl WebhookSender<HttpConnector> {
    /// A sender to `url` (plain `http://`) signing with `secret`, on a pooled HTTP/1.1 client
    /// whose connections idle out after 30 s.
    pub fn new(url: Uri, secret: WebhookSecret) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(connector);
        Self::with_client(client, url, secret)
    }
}

impl<C> WebhookSender<C> {
    /// A sender on a client of your own: another connector (TLS, a proxy), other pool settings.
    pub fn with_client(client: Client<C, Full<Bytes>>, url: Uri, secret: WebhookSecret) -> Self {
        Self { client, url, secret }
    }
}

impl<C: Connect + Clone + Send + Sync + 'static> Sender for WebhookSender<C> {
    async fn send(&self, event: &PendingEvent) -> Result<(), SendError> {
        let timestamp = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        let id = event.id.as_str();
        let request = Request::post(self.url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header(WEBHOOK_ID_HEADER, id)
            .header(TIMESTAMP_HEADER, timestamp.to_string())
            .header(SIGNATURE_HEADER, self.secret.sign(id, timestamp, &event.body))
            .body(Full::new(event.body.clone()))
            .map_err(|error| SendError::Transport(error.to_string()))?;
        let response = self.client.request(request).await.map_err(|error| SendError::Transport(error.to_string()))?;
        let status = response.status();
        // Read (a bounded part of) the answer so the connection goes back to the pool; its
        // content does not matter.
        let _ = Limited::new(response.into_body(), ANSWER_LIMIT).collect().await;
        if status.is_success() { Ok(()) } else { Err(SendError::Status(status)) }
    }
}
