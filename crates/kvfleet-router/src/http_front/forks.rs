//! `POST /v1/forks`: one parent conversation forked into N sub-agents that share its
//! prefix, computed once.
//!
//! Each child is built the way a cache-exploiting fork must be: the parent's messages
//! (ending with its assistant message and tool calls), then one `user` message with a
//! constant placeholder result for every tool call and the child's directive in
//! `<fork-directive>` tags. The children's token ids therefore share everything up to
//! the directive. The router sends that shared prefix once, with every child's tail,
//! in one `Fork` call: the worker prefills the prefix once and forks the sequence
//! copy-on-write. Children beyond one worker's budget go out in further `Fork` calls,
//! routed like any request (so they follow the prefix while its worker has room).

use super::relay::{next_message, Tally};
use super::{
    insert_header, off_runtime, parse_body, prompt_error, reject_unknown, request_id, unix_now,
    RequestMeta, FORK_GROUP_HEADER,
};
use crate::dispatch::{
    dispatch_with, finish_reason_name, report_usage, Dispatched, GenerationSpec,
};
use crate::fleet::Fleet;
use crate::openai::error::ApiError;
use crate::openai::params::{sampling_params, Api};
use crate::openai::tool_call_parser::parse_tool_calls;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::future::join_all;
use kvfleet_core::chat::fork_message::{fork_child_message, DEFAULT_PLACEHOLDER};
use kvfleet_core::chat::{ChatMessage, Role, ToolDefinition};
use kvfleet_core::openai::{AssistantMessage, SamplingFields, UnknownFields, Usage};
use kvfleet_proto::v1 as pb;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Most directives one fork request may carry.
pub const MAX_DIRECTIVES: usize = 256;

/// `POST /v1/forks`.
#[derive(Clone, Debug, Deserialize)]
pub struct ForkRequestBody {
    /// Model id.
    pub model: String,
    /// The parent conversation, normally ending with its assistant message whose tool
    /// calls the children handle.
    pub messages: Vec<ChatMessage>,
    /// Tools, as in chat completions.
    #[serde(default)]
    pub tools: Option<Vec<ToolDefinition>>,
    /// One directive per child.
    pub directives: Vec<String>,
    /// The constant result written for every tool call (a default when absent).
    pub placeholder: Option<String>,
    /// Sampling, shared by every child.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Top-level fields nothing above accepts (a 400). Must stay the last field.
    #[serde(flatten)]
    pub unknown: UnknownFields,
}

/// One child's answer.
#[derive(Clone, Debug, Serialize)]
pub struct ForkChoice {
    /// Position of the directive.
    pub index: usize,
    /// The directive.
    pub directive: String,
    /// The answer.
    pub message: AssistantMessage,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: Option<&'static str>,
    /// The worker that served the child.
    pub worker: String,
    /// The child's own token accounting (`cached_tokens` includes the shared prefix
    /// it reused from the fork).
    pub usage: Usage,
}

/// How the shared prefix was served.
#[derive(Clone, Debug, Serialize)]
pub struct ForkSummary {
    /// The fork group the children belong to.
    pub fork_group: String,
    /// Tokens every child shares.
    pub shared_prefix_tokens: usize,
    /// `Fork` calls made (one per worker share of the children).
    pub fork_calls: usize,
    /// Workers that served children, in call order.
    pub workers: Vec<String>,
}

/// The `/v1/forks` answer.
#[derive(Clone, Debug, Serialize)]
pub struct ForkResponseBody {
    /// `fork-…`.
    pub id: String,
    /// `fork`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// One choice per directive, in directive order.
    pub choices: Vec<ForkChoice>,
    /// Totals over every child.
    pub usage: Usage,
    /// How the prefix was shared.
    pub fork: ForkSummary,
}

/// Handles a fork request.
pub async fn forks(
    State(fleet): State<Arc<Fleet>>,
    headers: HeaderMap,
    admitted: Option<axum::Extension<super::gate::Admitted>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body_bytes = body.len();
    let mut req: ForkRequestBody = off_runtime(body_bytes, move || parse_body(&body)).await?;
    reject_unknown(&req.unknown)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must not be empty",
        ));
    }
    if req.directives.is_empty() || req.directives.len() > MAX_DIRECTIVES {
        return Err(ApiError::invalid_param(
            "directives",
            format!("give between 1 and {MAX_DIRECTIVES} directives"),
        ));
    }
    if req.sampling.stream {
        return Err(ApiError::invalid_param(
            "stream",
            "/v1/forks answers with one JSON body; streaming is not supported",
        ));
    }
    if crate::openai::params::choices(&req.sampling)? != 1 {
        return Err(ApiError::invalid_param(
            "n",
            "/v1/forks serves one answer per directive: n must be 1",
        ));
    }
    let meta = RequestMeta::from_headers(
        "forks",
        &fleet,
        &headers,
        super::admitted(admitted),
        &req.model,
        req.sampling.cache_salt.as_deref(),
    )?;
    let tools = req.tools.clone().unwrap_or_default();
    let tool_calls = match req.messages.last() {
        Some(m) if m.role == Role::Assistant => m.tool_calls.clone(),
        _ => Vec::new(),
    };
    let placeholder = req.placeholder.as_deref().unwrap_or(DEFAULT_PLACEHOLDER);

    let tails: Vec<Vec<ChatMessage>> = req
        .directives
        .iter()
        .map(|d| vec![fork_child_message(&tool_calls, placeholder, d)])
        .collect();
    // The parent's history is rendered and tokenized once for every child.
    let (messages, child_tools, scope, work) = (
        std::mem::take(&mut req.messages),
        tools.clone(),
        meta.scope(),
        fleet.clone(),
    );
    let children: Vec<Vec<u32>> = off_runtime(body_bytes, move || {
        let prompts = work
            .tokens
            .tokenize_tails(&work.prompt, &scope, &messages, &tails, &child_tools)
            .map_err(prompt_error)?;
        Ok(prompts.into_iter().map(|p| p.ids).collect())
    })
    .await?;
    let shared = shared_prefix_len(&children);
    let longest = children.iter().map(Vec::len).max().unwrap_or(0);
    let mut sampling = sampling_params(&req.sampling, Api::Forks, longest, meta.context)?;
    meta.admitted.cap_completion(&req.sampling, &mut sampling)?;
    // The shared prefix is prefilled once; every child adds its tail and budget.
    let cost = shared
        + children
            .iter()
            .map(|c| c.len() - shared + sampling.max_tokens.max(0) as usize)
            .sum::<usize>();
    meta.admitted.charge(longest, cost)?;
    let seed = kvfleet_core::namespace_seed(&meta.model_id, &meta.cache_salt);
    let prefix: Arc<[u32]> = children[0][..shared].into();
    let hashes: Arc<[kvfleet_core::BlockHash]> =
        kvfleet_core::hash_blocks(seed, &prefix, fleet.routing.block_size()).into();
    let fork_id = request_id();
    let group = meta
        .fork_group
        .clone()
        .unwrap_or_else(|| format!("fork-{fork_id}"));

    // One Fork call per worker share of the children.
    let per_call = fleet.config.fork_children_per_worker.max(1);
    let indexed: Vec<(usize, Vec<u32>)> = children
        .iter()
        .enumerate()
        .map(|(i, ids)| (i, ids[shared..].to_vec()))
        .collect();
    let calls = indexed.chunks(per_call).enumerate().map(|(k, part)| {
        let spec = GenerationSpec {
            request_id: format!("{fork_id}-{k}"),
            token_ids: prefix.clone(),
            hashes: hashes.clone(),
            sampling: sampling.clone(),
            cache_salt: meta.cache_salt.clone(),
            cacheable_len: None,
            fork_group: Some(group.clone()),
            session: meta.session.clone(),
            policy: meta.policy,
            endpoint: "forks",
            pin: None,
        };
        let fleet = fleet.clone();
        let part = part.to_vec();
        let usage_tenant = meta.usage_tenant.clone();
        async move {
            let block_size = fleet.routing.block_size() as u32;
            // A fork computes its prefix where it lands: no peer pull.
            let mut d = dispatch_with(&fleet, &spec, &[], |conn, _pull| {
                let req = pb::ForkRequest {
                    request_id: spec.request_id.clone(),
                    model: String::new(),
                    prefix_token_ids: spec.token_ids.to_vec(),
                    block_hashes: spec.hashes.iter().map(|h| h.0).collect(),
                    block_size,
                    cache_salt: spec.cache_salt.clone(),
                    children: part
                        .iter()
                        .map(|(_, suffix)| pb::ForkChild {
                            suffix_token_ids: suffix.clone(),
                            sampling: Some(spec.sampling.clone()),
                        })
                        .collect(),
                    fork_group: spec.fork_group.clone(),
                    report_acceptance: true,
                };
                async move { conn.fork(req).await }
            })
            .await?;
            d.facts.cache_salt = usage_tenant;
            let indices: Vec<usize> = part.iter().map(|(i, _)| *i).collect();
            collect_fork(&fleet, d, &indices, spec.token_ids.len()).await
        }
    });
    let results = join_all(calls).await;

    let mut choices: Vec<Option<ForkChoice>> = vec![None; req.directives.len()];
    let mut workers = Vec::new();
    let id = format!("fork-{fork_id}");
    for r in results {
        let (worker, outs) = r?;
        workers.push(worker.clone());
        for (index, out) in outs {
            let (content, calls) = if tools.is_empty() {
                (out.text, Vec::new())
            } else {
                parse_tool_calls(&out.text, &id)
            };
            let finish = if calls.is_empty() {
                out.finish
            } else {
                Some("tool_calls")
            };
            choices[index] = Some(ForkChoice {
                index,
                directive: req.directives[index].clone(),
                message: AssistantMessage {
                    role: "assistant",
                    content: (!content.is_empty() || calls.is_empty()).then_some(content),
                    tool_calls: calls,
                },
                finish_reason: finish,
                worker: worker.clone(),
                usage: out.usage,
            });
        }
    }
    let choices: Vec<ForkChoice> = choices.into_iter().flatten().collect();
    if choices.len() != req.directives.len() {
        // A worker's failure, like every other way a fork ends early: 502.
        return Err(ApiError::worker_failed(
            "a worker ended the fork before every child finished",
        ));
    }
    let mut usage = Usage::default();
    for c in &choices {
        usage.prompt_tokens += c.usage.prompt_tokens;
        usage.completion_tokens += c.usage.completion_tokens;
        usage.prompt_tokens_details.cached_tokens += c.usage.prompt_tokens_details.cached_tokens;
    }
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
    let body = ForkResponseBody {
        id,
        object: "fork",
        created: unix_now(),
        model: meta.model_id.clone(),
        choices,
        usage,
        fork: ForkSummary {
            fork_group: group.clone(),
            shared_prefix_tokens: shared,
            fork_calls: workers.len(),
            workers,
        },
    };
    let mut headers = HeaderMap::new();
    insert_header(&mut headers, FORK_GROUP_HEADER, &group);
    Ok((headers, Json(body)).into_response())
}

/// The longest prefix every child shares, leaving each child at least one token of
/// its own (the engine forks after the prefix).
pub fn shared_prefix_len(children: &[Vec<u32>]) -> usize {
    let Some(first) = children.first() else {
        return 0;
    };
    let mut shared = first.len();
    for c in &children[1..] {
        shared = shared.min(first.iter().zip(c).take_while(|(a, b)| a == b).count());
    }
    let shortest = children.iter().map(Vec::len).min().unwrap_or(0);
    shared.min(shortest.saturating_sub(1))
}

/// What one child produced.
#[derive(Debug, Default)]
struct ChildOut {
    text: String,
    finish: Option<&'static str>,
    usage: Usage,
}

/// Reads a Fork stream to its end; children are reported under their request-wide
/// `indices` (the call's child i is `indices[i]`). `prefix_tokens` is the shared
/// prefix the call was routed by.
async fn collect_fork(
    fleet: &Fleet,
    mut d: Dispatched<pb::ForkResponse>,
    indices: &[usize],
    prefix_tokens: usize,
) -> Result<(String, Vec<(usize, ChildOut)>), ApiError> {
    let mut outs: Vec<ChildOut> = indices.iter().map(|_| ChildOut::default()).collect();
    let mut tallies: Vec<Tally> = indices.iter().map(|_| Tally::new(d.started)).collect();
    let mut msg = Some(std::mem::take(&mut d.first));
    while let Some(cur) = msg.take() {
        let i = cur.child_index as usize;
        if let (Some(out), Some(resp)) = (outs.get_mut(i), cur.response.as_ref()) {
            tallies[i].message(resp);
            out.text.push_str(&resp.text);
            if let Some(f) = finish_reason_name(resp.finish_reason) {
                out.finish = Some(f);
            }
        }
        // The same stall deadline and breaker accounting as a single generation.
        msg = match next_message(fleet, &mut d).await {
            Ok(m) => m,
            Err(e) => {
                fleet
                    .decisions
                    .outcome(d.guard.decision_seq, None, Some("worker_error"));
                return Err(ApiError::worker_failed(e.message(&d.worker)));
            }
        };
    }
    let mut done = Vec::with_capacity(outs.len());
    // The call's decision covers the shared prefix: the part of it every child got
    // from cache.
    let mut prefix_cached: Option<usize> = None;
    for (k, mut out) in outs.into_iter().enumerate() {
        let outcome = if out.finish.is_some() {
            "ok"
        } else {
            "worker_error"
        };
        out.usage = tallies[k].close_counts(d.guard.policy, outcome);
        report_usage(fleet, &d, &out.usage, tallies[k].ttft());
        let cached = out
            .usage
            .prompt_tokens_details
            .cached_tokens
            .min(prefix_tokens);
        prefix_cached = Some(prefix_cached.map_or(cached, |c| c.min(cached)));
        if out.finish.is_none() {
            fleet
                .decisions
                .outcome(d.guard.decision_seq, prefix_cached, Some("worker_error"));
            return Err(ApiError::worker_failed(format!(
                "worker {} ended fork child {k} early",
                d.worker
            )));
        }
        done.push((indices[k], out));
    }
    fleet
        .decisions
        .outcome(d.guard.decision_seq, prefix_cached, Some("ok"));
    Ok((d.worker, done))
}

#[cfg(test)]
mod tests {
    use super::shared_prefix_len;

    #[test]
    fn shared_prefix_leaves_every_child_a_tail() {
        assert_eq!(shared_prefix_len(&[vec![1, 2, 3, 4], vec![1, 2, 5]]), 2);
        assert_eq!(shared_prefix_len(&[vec![1, 2, 3]]), 2);
        assert_eq!(shared_prefix_len(&[vec![1, 2, 3], vec![1, 2, 3]]), 2);
        assert_eq!(shared_prefix_len(&[vec![1, 2, 3], vec![1, 2]]), 1);
        assert_eq!(shared_prefix_len(&[]), 0);
    }
}
