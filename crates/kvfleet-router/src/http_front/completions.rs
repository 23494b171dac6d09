//! `POST /v1/completions`: a prompt given as text or as token ids.

use super::relay::{collect_choices, stream_choices, ChunkWriter};
use super::{off_runtime, parse_body, prepare, reject_unknown, unix_now, Prepared, RequestMeta};
use crate::fleet::Fleet;
use crate::openai::error::ApiError;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvfleet_core::openai::{Completion, CompletionChoice, CompletionRequest, PromptInput, Usage};
use kvfleet_proto::v1 as pb;
use std::sync::Arc;

/// Handles a text completion, streamed or not.
pub async fn completions(
    State(fleet): State<Arc<Fleet>>,
    headers: HeaderMap,
    admitted: Option<axum::Extension<super::gate::Admitted>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = off_runtime(body.len(), move || parse_body(&body)).await?;
    reject_unknown(&req.unknown)?;
    if req.echo {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    let meta = RequestMeta::from_headers(
        "completions",
        &fleet,
        &headers,
        super::admitted(admitted),
        &req.model,
        req.sampling.cache_salt.as_deref(),
    )?;
    let grammar = super::checked_grammar(req.sampling.response_format.as_ref(), None, &[]).await?;
    let vocab = fleet.prompt.tokenizer.vocab_size();
    let ids = match req.prompt {
        PromptInput::Text(t) => encode(&fleet, t).await?,
        PromptInput::Texts(mut v) if v.len() == 1 => encode(&fleet, v.remove(0)).await?,
        PromptInput::Tokens(ids) => token_ids(&ids, vocab)?,
        PromptInput::TokenLists(mut v) if v.len() == 1 => token_ids(&v.remove(0), vocab)?,
        _ => {
            return Err(ApiError::invalid_param(
                "prompt",
                "exactly one prompt per request is served",
            ))
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
    }
    let Prepared {
        dispatched,
        more,
        worker_header,
        want_logprobs,
    } = prepare(&fleet, &meta, ids, None, &req.sampling, grammar, None).await?;
    // The router's request id, so a response can be found in the decision log.
    let id = format!("cmpl-{}", dispatched.request_id);
    let created = unix_now();
    let model = meta.model_id.clone();
    if req.sampling.stream {
        let include_usage = req
            .sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        let writer = |index| TextChunks {
            index,
            id: id.clone(),
            created,
            model: model.clone(),
            tokenizer: want_logprobs.then(|| fleet.prompt.tokenizer.clone()),
            sent: 0,
        };
        return Ok(stream_choices(
            fleet.clone(),
            worker_header,
            dispatched,
            more,
            writer,
            include_usage,
        ));
    }
    let (outs, usage, worker) = collect_choices(&fleet, dispatched, more).await?;
    let worker_header = super::served_by(worker_header, &worker);
    let choices = outs
        .into_iter()
        .enumerate()
        .map(|(index, out)| CompletionChoice {
            index,
            logprobs: want_logprobs.then(|| {
                crate::openai::logprobs::completion(&*fleet.prompt.tokenizer, &out.logprobs, 0)
            }),
            text: out.text,
            finish_reason: out.finish,
        })
        .collect();
    let body = Completion {
        id,
        object: "text_completion",
        created,
        model,
        choices,
        usage: Some(usage),
    };
    Ok((worker_header, Json(body)).into_response())
}

/// Tokenizes a text prompt off the async runtime (it grows with the body).
async fn encode(fleet: &Arc<Fleet>, text: String) -> Result<Vec<u32>, ApiError> {
    let tokenizer = fleet.prompt.tokenizer.clone();
    off_runtime(text.len(), move || {
        tokenizer
            .encode_text_prompt(&text)
            .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))
    })
    .await
}

fn token_ids(ids: &[i64], vocab: usize) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&t| {
            u32::try_from(t)
                .ok()
                .filter(|t| (*t as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        "prompt",
                        format!("token id {t} is outside the vocabulary (size {vocab})"),
                    )
                })
        })
        .collect()
}

struct TextChunks {
    /// The choice these chunks belong to.
    index: usize,
    id: String,
    created: u64,
    model: String,
    /// Set when the request asked for logprobs.
    tokenizer: Option<Arc<dyn kvfleet_core::Tokenizer>>,
    /// Bytes of text sent so far (the next token's `text_offset`).
    sent: usize,
}

impl TextChunks {
    fn chunk(
        &self,
        text: String,
        finish: Option<&'static str>,
        usage: Option<Usage>,
        choice: bool,
    ) -> String {
        self.chunk_with(text, None, finish, usage, choice)
    }

    fn chunk_with(
        &self,
        text: String,
        logprobs: Option<kvfleet_core::openai::CompletionLogprobs>,
        finish: Option<&'static str>,
        usage: Option<Usage>,
        choice: bool,
    ) -> String {
        let c = Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: if choice {
                vec![CompletionChoice {
                    index: self.index,
                    text,
                    finish_reason: finish,
                    logprobs,
                }]
            } else {
                Vec::new()
            },
            usage,
        };
        serde_json::to_string(&c).unwrap_or_default()
    }
}

impl ChunkWriter for TextChunks {
    fn start(&mut self) -> Vec<String> {
        Vec::new()
    }
    fn text(&mut self, delta: &str, logprobs: &[pb::TokenLogprob]) -> Vec<String> {
        let lps = self
            .tokenizer
            .as_ref()
            .map(|t| crate::openai::logprobs::completion(&**t, logprobs, self.sent));
        if let Some(l) = &lps {
            self.sent = l.text_offset.last().copied().unwrap_or(self.sent)
                + l.tokens.last().map_or(0, String::len);
        }
        vec![self.chunk_with(delta.to_string(), lps, None, None, true)]
    }
    fn finish(&mut self, reason: &'static str, usage: Option<&Usage>) -> Vec<String> {
        let mut out = vec![self.chunk(String::new(), Some(reason), None, true)];
        if let Some(u) = usage {
            out.push(self.usage_chunk(u));
        }
        out
    }
    fn usage_chunk(&mut self, usage: &Usage) -> String {
        self.chunk(String::new(), None, Some(usage.clone()), false)
    }
}
