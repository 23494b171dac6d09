//! `POST /v1/completions`: a prompt given as text or as token ids.

use super::relay::{collect, relay_sse, ChunkWriter};
use super::{parse_body, prepare, sse_response, unix_now, Prepared, RequestMeta};
use crate::fleet::Fleet;
use crate::openai::error::ApiError;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvfleet_core::tokenizer::{Tokenizer, TokenizerError};
use kvfleet_core::openai::{Completion, CompletionChoice, CompletionRequest, PromptInput, Usage};
use std::sync::Arc;

/// Handles a text completion, streamed or not.
pub async fn completions(
    State(fleet): State<Arc<Fleet>>,
    headers: HeaderMap,
    admitted: Option<axum::Extension<super::gate::Admitted>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(&body)?;
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
    let vocab = fleet.prompt.tokenizer.vocab_size();
    let ids = match req.prompt {
        PromptInput::Text(t) => encode(&fleet, &t)?,
        PromptInput::Texts(mut v) if v.len() == 1 => encode(&fleet, &v.remove(0))?,
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
        worker_header,
    } = prepare(&fleet, &meta, ids, None, &req.sampling).await?;
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
        let writer = TextChunks { id, created, model };
        return Ok(sse_response(worker_header, move |tx| {
            relay_sse(fleet, dispatched, writer, include_usage, tx)
        }));
    }
    let (out, _) = collect(&fleet, dispatched).await?;
    let body = Completion {
        id,
        object: "text_completion",
        created,
        model,
        choices: vec![CompletionChoice {
            index: 0,
            text: out.text,
            finish_reason: out.finish,
            logprobs: None,
        }],
        usage: Some(out.usage),
    };
    Ok((worker_header, Json(body)).into_response())
}

fn encode(fleet: &Fleet, text: &str) -> Result<Vec<u32>, ApiError> {
    text_prompt_ids(fleet.prompt.tokenizer.as_ref(), text)
        .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))
}

/// The ids of a raw-text prompt: its tokens, after the BOS the model's tokenizer asks
/// for (`add_bos_token`), as `transformers` and llama.cpp tokenize a completion prompt.
/// A prompt that already starts with BOS (written as text) keeps just that one; token-id
/// prompts are taken as given.
fn text_prompt_ids(tokenizer: &dyn Tokenizer, text: &str) -> Result<Vec<u32>, TokenizerError> {
    let mut ids = tokenizer.encode(text)?;
    if let Some(bos) = tokenizer.bos_token_id_to_add() {
        if !ids.is_empty() && ids.first() != Some(&bos) {
            ids.insert(0, bos);
        }
    }
    Ok(ids)
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
    id: String,
    created: u64,
    model: String,
}

impl TextChunks {
    fn chunk(
        &self,
        text: String,
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
                    index: 0,
                    text,
                    finish_reason: finish,
                    logprobs: None,
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
    fn text(&mut self, delta: &str) -> Vec<String> {
        vec![self.chunk(delta.to_string(), None, None, true)]
    }
    fn finish(&mut self, reason: &'static str, usage: Option<&Usage>) -> Vec<String> {
        let mut out = vec![self.chunk(String::new(), Some(reason), None, true)];
        if let Some(u) = usage {
            out.push(self.chunk(String::new(), None, Some(u.clone()), false));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::tokenizer::ByteTokenizer;

    /// The byte tokenizer, asking for `<|endoftext|>` (256) as BOS.
    struct WithBos(ByteTokenizer);

    impl Tokenizer for WithBos {
        fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
            self.0.encode(text)
        }
        fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
            self.0.decode(ids)
        }
        fn vocab_size(&self) -> usize {
            self.0.vocab_size()
        }
        fn token_id(&self, token: &str) -> Option<u32> {
            self.0.token_id(token)
        }
        fn eos_token_ids(&self) -> Vec<u32> {
            self.0.eos_token_ids()
        }
        fn bos_token_id_to_add(&self) -> Option<u32> {
            Some(256)
        }
    }

    #[test]
    fn text_prompts_get_bos_once_when_the_tokenizer_asks() {
        let with = WithBos(ByteTokenizer::new());
        assert_eq!(text_prompt_ids(&with, "hi").unwrap(), vec![256, 104, 105]);
        assert_eq!(
            text_prompt_ids(&with, "<|endoftext|>hi").unwrap(),
            vec![256, 104, 105]
        );
        assert!(text_prompt_ids(&with, "").unwrap().is_empty());
        let without = ByteTokenizer::new();
        assert_eq!(text_prompt_ids(&without, "hi").unwrap(), vec![104, 105]);
    }
}
