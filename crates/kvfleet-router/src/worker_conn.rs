//! One gRPC connection from the router to a worker, with a deadline on every unary call.

use kvfleet_proto::v1 as pb;
use kvfleet_proto::v1::worker_client::WorkerClient;
use std::time::Duration;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// How long a connection attempt may take (default).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline of unary calls (Info, Load, CacheDump, Abort) (default).
pub const UNARY_TIMEOUT: Duration = Duration::from_secs(10);

/// The deadlines of one connection.
#[derive(Clone, Copy, Debug)]
pub struct ConnTimeouts {
    /// TCP connect.
    pub connect: Duration,
    /// Every unary call (Info, Load, CacheDump, Abort).
    pub unary: Duration,
}

impl Default for ConnTimeouts {
    fn default() -> Self {
        ConnTimeouts {
            connect: CONNECT_TIMEOUT,
            unary: UNARY_TIMEOUT,
        }
    }
}

/// A connected worker.
#[derive(Clone, Debug)]
pub struct WorkerConn {
    /// The worker's gRPC endpoint (`http://host:port`).
    pub endpoint: String,
    /// What the worker said about itself.
    pub info: pb::InfoResponse,
    client: WorkerClient<Channel>,
    timeouts: ConnTimeouts,
}

/// Why talking to a worker failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The address is not a valid endpoint.
    #[error("bad worker endpoint {0}: {1}")]
    Endpoint(String, String),
    /// Could not connect.
    #[error("cannot connect to worker at {0}: {1}")]
    Connect(String, String),
    /// The call failed.
    #[error("worker call failed: {0}")]
    Status(#[from] tonic::Status),
}

impl WorkerConn {
    /// Connects to `endpoint` (`host:port`, `http://host:port` or `https://host:port`)
    /// and asks for its Info, with these deadlines. With `tls`, the connection is TLS (a
    /// bare `host:port` becomes `https://`) and the worker's certificate must verify
    /// against its CA.
    pub async fn connect_with(
        endpoint: &str,
        timeouts: ConnTimeouts,
        tls: Option<&ClientTlsConfig>,
    ) -> Result<Self, ConnError> {
        let uri = if endpoint.contains("://") {
            endpoint.to_string()
        } else if tls.is_some() {
            format!("https://{endpoint}")
        } else {
            format!("http://{endpoint}")
        };
        let mut ep = Endpoint::from_shared(uri.clone())
            .map_err(|e| ConnError::Endpoint(uri.clone(), e.to_string()))?;
        if let Some(tls) = tls {
            if !uri.starts_with("https://") {
                return Err(ConnError::Endpoint(
                    uri,
                    "worker TLS is configured, so the endpoint must be https://".into(),
                ));
            }
            ep = ep
                .tls_config(tls.clone())
                .map_err(|e| ConnError::Endpoint(uri.clone(), e.to_string()))?;
        }
        let ep = ep
            .connect_timeout(timeouts.connect)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5));
        // The connect timeout covers TCP only; a process that accepts but never answers
        // (stopped, hung) must not hold the HTTP/2 handshake forever either.
        let channel = tokio::time::timeout(timeouts.connect + timeouts.unary, ep.connect())
            .await
            .map_err(|_| ConnError::Connect(uri.clone(), "handshake timed out".into()))?
            .map_err(|e| ConnError::Connect(uri.clone(), error_chain(&e)))?;
        let mut client = WorkerClient::new(channel)
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20);
        let info = client
            .info(with_deadline(pb::InfoRequest {}, timeouts.unary))
            .await?
            .into_inner();
        Ok(WorkerConn {
            endpoint: uri,
            info,
            client,
            timeouts,
        })
    }

    /// The worker's id.
    pub fn id(&self) -> &str {
        &self.info.worker_id
    }

    /// Current load.
    pub async fn load(&self) -> Result<pb::LoadResponse, ConnError> {
        Ok(self
            .client
            .clone()
            .load(self.deadline(pb::LoadRequest {}))
            .await?
            .into_inner())
    }

    /// Every cached block and the event seq it reflects.
    pub async fn cache_dump(&self) -> Result<pb::CacheDumpResponse, ConnError> {
        Ok(self
            .client
            .clone()
            .cache_dump(self.deadline(pb::CacheDumpRequest {}))
            .await?
            .into_inner())
    }

    /// KV events from `from_seq` on (replay, then live).
    pub async fn kv_events(
        &self,
        from_seq: u64,
    ) -> Result<tonic::Streaming<pb::KvEventBatch>, ConnError> {
        Ok(self
            .client
            .clone()
            .kv_events(pb::KvEventsRequest { from_seq })
            .await?
            .into_inner())
    }

    /// Starts a generation; the stream yields its messages.
    pub async fn generate(
        &self,
        req: pb::GenerateRequest,
    ) -> Result<tonic::Streaming<pb::GenerateResponse>, tonic::Status> {
        Ok(self.client.clone().generate(req).await?.into_inner())
    }

    /// Starts a fork: the prefix once, then every child; the stream yields the
    /// children's messages tagged with their index.
    pub async fn fork(
        &self,
        req: pb::ForkRequest,
    ) -> Result<tonic::Streaming<pb::ForkResponse>, tonic::Status> {
        Ok(self.client.clone().fork(req).await?.into_inner())
    }

    /// Aborts a request by id.
    pub async fn abort(&self, request_id: &str) -> Result<bool, ConnError> {
        Ok(self
            .client
            .clone()
            .abort(self.deadline(pb::AbortRequest {
                request_id: request_id.to_string(),
            }))
            .await?
            .into_inner()
            .found)
    }
}

/// `e` and its sources, `: `-joined: tonic's transport error alone says only
/// "transport error", its sources say why (e.g. an unknown certificate issuer).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        // Wrappers often repeat their source's message; say it once.
        if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

impl WorkerConn {
    fn deadline<T>(&self, msg: T) -> tonic::Request<T> {
        with_deadline(msg, self.timeouts.unary)
    }
}

/// A request carrying a gRPC deadline, also enforced on this side: a peer that never
/// answers (a stopped process) still ends the call.
fn with_deadline<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}
