//! A scripted worker over real gRPC on loopback: it answers `Info`, `Load`, `CacheDump`
//! and `KvEvents` like a worker holding one cached prompt, and each `Generate` the way
//! its [`Script`] says, counting calls, aborts and dumps. An optional [`Proxy`] in front
//! of it can cut every open connection (a transport failure).

#![allow(dead_code)]

use futures::Stream;
use kvfleet_proto::v1 as pb;
use kvfleet_proto::v1::worker_server::{Worker, WorkerServer};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Code, Request, Response, Status};

/// Tokens per block of every fake worker.
pub const BS: u32 = 16;
/// The model every fake worker serves.
pub const MODEL: &str = "fake-model";

/// A one-token chat request for `tokens` (hashed as a fake worker's model), as the
/// router's tests dispatch it.
pub fn chat_spec(
    id: &str,
    tokens: Vec<u32>,
) -> std::sync::Arc<kvfleet_router::dispatch::GenerationSpec> {
    std::sync::Arc::new(kvfleet_router::dispatch::GenerationSpec {
        request_id: id.to_string(),
        hashes: kvfleet_core::hash_blocks(
            kvfleet_core::namespace_seed(MODEL, ""),
            &tokens,
            BS as usize,
        )
        .into(),
        token_ids: tokens.into(),
        sampling: pb::SamplingParams {
            max_tokens: 1,
            ..Default::default()
        },
        cache_salt: String::new(),
        cacheable_len: None,
        fork_group: None,
        session: None,
        policy: kvfleet_router::PolicyKind::CacheAware,
        endpoint: "chat",
        pin: None,
    })
}

/// How a fake worker answers `Generate`.
#[derive(Clone, Debug)]
pub enum Script {
    /// Acknowledges (when asked), then one message with usage and a finish.
    Answer,
    /// Acknowledges at once (when asked), waits this long (a deep queue), then answers.
    QueueFor(Duration),
    /// Acknowledges (when asked), then never sends anything more.
    QueueForever,
    /// Sends nothing at all, not even an acknowledgement (a hung or old worker).
    Silent,
    /// Fails the call with this code before any message.
    Reject(Code),
    /// Acknowledges (when asked), then ends the stream with this code.
    FailAfterAccept(Code),
    /// Acknowledges (when asked), sends the prompt's usage and a first token "y", then
    /// nothing more (a worker hung mid-generation).
    StallAfterFirst,
    /// Acknowledges (when asked), sends the first token "y", then ends the stream with
    /// this code.
    FailAfterFirst(Code),
}

/// What a fake worker counted.
#[derive(Default)]
pub struct Counters {
    /// `Generate` calls.
    pub generates: AtomicUsize,
    /// `Abort` calls.
    pub aborts: AtomicUsize,
    /// `CacheDump` calls.
    pub dumps: AtomicUsize,
}

#[derive(Clone)]
struct Fake {
    id: String,
    cached: Arc<Vec<pb::CachedBlock>>,
    script: Arc<Mutex<Script>>,
    counters: Arc<Counters>,
}

/// A running fake worker.
pub struct FakeWorker {
    /// Worker id.
    pub id: String,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// What it counted.
    pub counters: Arc<Counters>,
    script: Arc<Mutex<Script>>,
    server: JoinHandle<()>,
}

impl FakeWorker {
    /// Starts worker `id` holding `cached` (hash, parent) blocks, answering with `script`.
    pub async fn start(id: &str, cached: &[(u64, Option<u64>)], script: Script) -> FakeWorker {
        let fake = Fake {
            id: id.to_string(),
            cached: Arc::new(
                cached
                    .iter()
                    .map(|&(hash, parent_hash)| pb::CachedBlock {
                        medium: Default::default(),
                        hash,
                        parent_hash,
                    })
                    .collect(),
            ),
            script: Arc::new(Mutex::new(script)),
            counters: Arc::new(Counters::default()),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (script, counters) = (fake.script.clone(), fake.counters.clone());
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(WorkerServer::new(fake))
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await;
        });
        FakeWorker {
            id: id.to_string(),
            endpoint: format!("http://{addr}"),
            counters,
            script,
            server,
        }
    }

    /// Answers later calls with `script`.
    pub fn set_script(&self, script: Script) {
        *self.script.lock().unwrap() = script;
    }

    /// `Generate` calls so far.
    pub fn generates(&self) -> usize {
        self.counters.generates.load(Ordering::SeqCst)
    }

    /// `Abort` calls so far.
    pub fn aborts(&self) -> usize {
        self.counters.aborts.load(Ordering::SeqCst)
    }

    /// `CacheDump` calls so far.
    pub fn dumps(&self) -> usize {
        self.counters.dumps.load(Ordering::SeqCst)
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn answer(prompt_tokens: usize) -> pb::GenerateResponse {
    pb::GenerateResponse {
        token_ids: vec![7],
        text: "x".into(),
        finish_reason: pb::FinishReason::Length as i32,
        usage: Some(pb::Usage {
            prompt_tokens: prompt_tokens as u32,
            cached_tokens: 0,
            completion_tokens: 1,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The first message of an unfinished generation: the prompt's usage and token "y".
fn first_token(prompt_tokens: usize) -> pb::GenerateResponse {
    pb::GenerateResponse {
        token_ids: vec![8],
        text: "y".into(),
        finish_reason: pb::FinishReason::Unspecified as i32,
        ..answer(prompt_tokens)
    }
}

type Sender = mpsc::Sender<Result<pb::GenerateResponse, Status>>;

async fn ack(tx: &Sender, asked: bool) {
    if asked {
        let msg = pb::GenerateResponse {
            accepted: Some(pb::Accepted { queue_position: 3 }),
            ..Default::default()
        };
        let _ = tx.send(Ok(msg)).await;
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Worker for Fake {
    type GenerateStream = ReceiverStream<Result<pb::GenerateResponse, Status>>;
    type ForkStream = BoxStream<pb::ForkResponse>;
    type KvEventsStream = BoxStream<pb::KvEventBatch>;
    type FetchBlocksStream = BoxStream<pb::KvBlockData>;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.counters.generates.fetch_add(1, Ordering::SeqCst);
        let req = request.into_inner();
        let script = self.script.lock().unwrap().clone();
        if let Script::Reject(code) = script {
            return Err(Status::new(code, format!("scripted {code:?}")));
        }
        let (tx, rx) = mpsc::channel(8);
        let asked = req.report_acceptance;
        let n = req.token_ids.len();
        tokio::spawn(async move {
            match script {
                Script::Answer => {
                    ack(&tx, asked).await;
                    let _ = tx.send(Ok(answer(n))).await;
                }
                Script::QueueFor(d) => {
                    ack(&tx, asked).await;
                    tokio::time::sleep(d).await;
                    let _ = tx.send(Ok(answer(n))).await;
                }
                Script::QueueForever => {
                    ack(&tx, asked).await;
                    tx.closed().await;
                }
                Script::Silent => tx.closed().await,
                Script::FailAfterAccept(code) => {
                    ack(&tx, asked).await;
                    let _ = tx
                        .send(Err(Status::new(code, format!("scripted {code:?}"))))
                        .await;
                }
                Script::StallAfterFirst => {
                    ack(&tx, asked).await;
                    let _ = tx.send(Ok(first_token(n))).await;
                    tx.closed().await;
                }
                Script::FailAfterFirst(code) => {
                    ack(&tx, asked).await;
                    let _ = tx.send(Ok(first_token(n))).await;
                    let _ = tx
                        .send(Err(Status::new(code, format!("scripted {code:?}"))))
                        .await;
                }
                Script::Reject(_) => {}
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn fork(
        &self,
        _request: Request<pb::ForkRequest>,
    ) -> Result<Response<Self::ForkStream>, Status> {
        Err(Status::unimplemented("the fake worker does not fork"))
    }

    async fn kv_events(
        &self,
        _request: Request<pb::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        // No events, ever: the stream stays open like a quiet worker's.
        Ok(Response::new(Box::pin(futures::stream::pending())))
    }

    async fn cache_dump(
        &self,
        _request: Request<pb::CacheDumpRequest>,
    ) -> Result<Response<pb::CacheDumpResponse>, Status> {
        self.counters.dumps.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(pb::CacheDumpResponse {
            worker_id: self.id.clone(),
            seq: 0,
            blocks: self.cached.as_ref().clone(),
        }))
    }

    async fn load(
        &self,
        _request: Request<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadResponse>, Status> {
        Ok(Response::new(pb::LoadResponse {
            worker_id: self.id.clone(),
            free_blocks: 1000,
            total_blocks: 1000,
            cached_blocks: self.cached.len() as u32,
            ..Default::default()
        }))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(pb::InfoResponse {
            worker_id: self.id.clone(),
            model_id: MODEL.into(),
            block_size: BS,
            num_blocks: 1000,
            max_context: 8192,
            vocab_size: 320,
            device: "fake".into(),
            max_num_seqs: 8,
            ..Default::default()
        }))
    }

    async fn abort(
        &self,
        _request: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortResponse>, Status> {
        self.counters.aborts.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(pb::AbortResponse { found: true }))
    }

    async fn fetch_blocks(
        &self,
        _request: Request<pb::FetchBlocksRequest>,
    ) -> Result<Response<Self::FetchBlocksStream>, Status> {
        Err(Status::failed_precondition("the fake worker holds no K/V"))
    }
}

/// A TCP proxy in front of an endpoint whose open connections can be cut at once.
pub struct Proxy {
    /// `http://127.0.0.1:PORT` of the proxy.
    pub endpoint: String,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Forwards to `target` (`http://host:port`).
    pub async fn start(target: &str) -> Proxy {
        let target = target.trim_start_matches("http://").to_string();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let held = conns.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                held.lock().unwrap().push(task);
            }
        });
        Proxy {
            endpoint: format!("http://{addr}"),
            conns,
            accept,
        }
    }

    /// Closes every connection open now (new ones are forwarded again).
    pub fn cut(&self) {
        for t in self.conns.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}
