//! Checking the sampling fields of a request and turning them into the worker's
//! sampling parameters; every bad value is a 400 naming the field.

use super::error::ApiError;
use kvfleet_core::openai::{LogprobsSpec, SamplingFields};
use kvfleet_proto::v1 as pb;

/// Most choices (`n`) one request may ask for.
pub const MAX_N: i64 = 16;

/// The number of choices a request asks for: `n`, 1..=[`MAX_N`] (absent: 1).
pub fn choices(f: &SamplingFields) -> Result<usize, ApiError> {
    match f.n.unwrap_or(1) {
        n @ 1..=MAX_N => Ok(n as usize),
        n => Err(ApiError::invalid_param(
            "n",
            format!("n must be between 1 and {MAX_N}, got {n}"),
        )),
    }
}

/// Which API's shape of `logprobs` a request uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`: `logprobs: bool` and `top_logprobs` 0..=20.
    Chat,
    /// `/v1/completions`: `logprobs` 0..=5.
    Completions,
    /// `/v1/forks`: no log-probabilities.
    Forks,
}

/// Most alternatives chat's `top_logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// Most alternatives legacy completions' `logprobs` may ask for.
pub const MAX_COMPLETION_LOGPROBS: i64 = 5;
/// Most `logit_bias` entries.
pub const MAX_LOGIT_BIAS: usize = 300;

/// The alternatives per token a request asks for (`None`: no logprobs at all).
fn logprobs(f: &SamplingFields, api: Api) -> Result<Option<u32>, ApiError> {
    let bad = |m: String| Err(ApiError::invalid_param("logprobs", m));
    let k = match (api, f.logprobs, f.top_logprobs) {
        (_, None | Some(LogprobsSpec::Flag(false)), None) => return Ok(None),
        (Api::Forks, _, _) => return bad("/v1/forks does not report logprobs".into()),
        (Api::Chat, Some(LogprobsSpec::Flag(true)), top) => {
            let k = top.unwrap_or(0);
            if !(0..=MAX_TOP_LOGPROBS).contains(&k) {
                return Err(ApiError::invalid_param(
                    "top_logprobs",
                    format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                ));
            }
            k
        }
        (Api::Chat, _, Some(_)) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs set to true",
            ))
        }
        (Api::Chat, Some(LogprobsSpec::Count(_)), None) => {
            return bad(
                "logprobs must be a boolean here; give top_logprobs for alternatives".into(),
            )
        }
        (Api::Completions, Some(LogprobsSpec::Count(k)), None) => {
            if !(0..=MAX_COMPLETION_LOGPROBS).contains(&k) {
                return bad(format!(
                    "logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {k}"
                ));
            }
            k
        }
        (Api::Completions, _, Some(_)) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs is a chat parameter; give logprobs as an integer",
            ))
        }
        (Api::Completions, _, None) => {
            return bad("logprobs must be an integer between 0 and 5 here".into())
        }
    };
    Ok(Some(k as u32))
}

/// `presence_penalty` or `frequency_penalty`, checked to -2..=2 (absent: 0).
fn penalty(name: &str, v: Option<f32>) -> Result<f32, ApiError> {
    let v = v.unwrap_or(0.0);
    if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
        return Err(ApiError::invalid_param(
            name,
            format!("{name} must be between -2 and 2, got {v}"),
        ));
    }
    Ok(v)
}

/// `logit_bias`: token ids as strings, biases -100..=100, at most [`MAX_LOGIT_BIAS`].
fn logit_bias(f: &SamplingFields) -> Result<Vec<pb::LogitBias>, ApiError> {
    let Some(map) = &f.logit_bias else {
        return Ok(Vec::new());
    };
    let bad = |m: String| Err(ApiError::invalid_param("logit_bias", m));
    if map.len() > MAX_LOGIT_BIAS {
        return bad(format!(
            "logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {}",
            map.len()
        ));
    }
    let mut out = Vec::with_capacity(map.len());
    for (k, &bias) in map {
        let Ok(token_id) = k.parse::<u32>() else {
            return bad(format!("logit_bias keys must be token ids, got {k:?}"));
        };
        if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
            return bad(format!(
                "logit_bias of token {k} must be between -100 and 100, got {bias}"
            ));
        }
        out.push(pb::LogitBias { token_id, bias });
    }
    Ok(out)
}

/// Validated sampling parameters for a prompt of `prompt_tokens` tokens on a model
/// with a `context` token window. `max_tokens` defaults to the rest of the window.
pub fn sampling_params(
    f: &SamplingFields,
    api: Api,
    prompt_tokens: usize,
    context: usize,
) -> Result<pb::SamplingParams, ApiError> {
    if prompt_tokens >= context {
        return Err(ApiError::context_length(format!(
            "This model's maximum context length is {context} tokens. However, your prompt has {prompt_tokens} tokens."
        )));
    }
    let room = context - prompt_tokens;
    let max_tokens = match f.max_completion_tokens.or(f.max_tokens) {
        Some(v) if v < 1 => {
            return Err(ApiError::invalid_param(
                "max_tokens",
                format!("max_tokens must be at least 1, got {v}"),
            ))
        }
        Some(v) if v as u64 > room as u64 => {
            return Err(ApiError::context_length(format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {v} in the completion).",
                prompt_tokens as u64 + v as u64
            )))
        }
        Some(v) => v as usize,
        None => room,
    };
    let temperature = f.temperature.unwrap_or(1.0);
    if !temperature.is_finite() || !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid_param(
            "temperature",
            format!("temperature must be between 0 and 2, got {temperature}"),
        ));
    }
    let top_p = f.top_p.unwrap_or(1.0);
    if !top_p.is_finite() || top_p <= 0.0 || top_p > 1.0 {
        return Err(ApiError::invalid_param(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => {
            return Err(ApiError::invalid_param(
                "top_k",
                format!("top_k must be -1, 0 or positive, got {k}"),
            ))
        }
    };
    let stop = f
        .stop_strings()
        .map_err(|m| ApiError::invalid_param("stop", m))?;
    Ok(pb::SamplingParams {
        temperature,
        top_k,
        top_p: Some(top_p),
        // Any integer is a valid seed; negative ones are reinterpreted, not refused.
        seed: f.seed.map(|s| s as u64),
        max_tokens: i32::try_from(max_tokens).unwrap_or(i32::MAX),
        stop,
        stop_token_ids: Vec::new(),
        ignore_eos: f.ignore_eos,
        // Set by the endpoint (`structured::request_grammar`), which knows the tools.
        grammar: None,
        logprobs: logprobs(f, api)?,
        presence_penalty: penalty("presence_penalty", f.presence_penalty)?,
        frequency_penalty: penalty("frequency_penalty", f.frequency_penalty)?,
        logit_bias: logit_bias(f)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> SamplingFields {
        serde_json::from_str(json).unwrap()
    }

    fn sampling_params_chat(
        f: &SamplingFields,
        prompt_tokens: usize,
        context: usize,
    ) -> Result<pb::SamplingParams, ApiError> {
        sampling_params(f, Api::Chat, prompt_tokens, context)
    }

    #[test]
    fn n_is_bounded() {
        assert_eq!(choices(&fields("{}")).unwrap(), 1);
        assert_eq!(choices(&fields(r#"{"n": 16}"#)).unwrap(), 16);
        for bad in [r#"{"n": 0}"#, r#"{"n": 17}"#, r#"{"n": -1}"#] {
            assert_eq!(
                choices(&fields(bad)).unwrap_err().param.as_deref(),
                Some("n")
            );
        }
    }

    #[test]
    fn logprobs_penalties_and_bias_are_checked_per_api() {
        let p = sampling_params_chat(&fields(r#"{"logprobs": true, "top_logprobs": 3}"#), 1, 9)
            .unwrap();
        assert_eq!(p.logprobs, Some(3));
        assert_eq!(
            sampling_params_chat(&fields("{}"), 1, 9).unwrap().logprobs,
            None
        );
        let c = |json: &str| sampling_params(&fields(json), Api::Completions, 1, 9);
        assert_eq!(c(r#"{"logprobs": 2}"#).unwrap().logprobs, Some(2));
        let p = sampling_params_chat(
            &fields(
                r#"{"presence_penalty": -2, "frequency_penalty": 1.5, "logit_bias": {"7": 100}}"#,
            ),
            1,
            9,
        )
        .unwrap();
        assert_eq!((p.presence_penalty, p.frequency_penalty), (-2.0, 1.5));
        assert_eq!(
            p.logit_bias,
            vec![pb::LogitBias {
                token_id: 7,
                bias: 100.0
            }]
        );
        let many: serde_json::Map<String, serde_json::Value> =
            (0..301).map(|i| (i.to_string(), 1.into())).collect();
        let many = serde_json::json!({ "logit_bias": many }).to_string();
        for (api, json, param) in [
            (
                Api::Chat,
                r#"{"logprobs": true, "top_logprobs": 21}"#,
                "top_logprobs",
            ),
            (Api::Chat, r#"{"top_logprobs": 2}"#, "top_logprobs"),
            (Api::Chat, r#"{"logprobs": 3}"#, "logprobs"),
            (Api::Completions, r#"{"logprobs": 6}"#, "logprobs"),
            (Api::Completions, r#"{"logprobs": true}"#, "logprobs"),
            (Api::Forks, r#"{"logprobs": true}"#, "logprobs"),
            (
                Api::Chat,
                r#"{"presence_penalty": 2.5}"#,
                "presence_penalty",
            ),
            (
                Api::Chat,
                r#"{"frequency_penalty": -3}"#,
                "frequency_penalty",
            ),
            (Api::Chat, r#"{"logit_bias": {"x": 1}}"#, "logit_bias"),
            (Api::Chat, r#"{"logit_bias": {"1": 101}}"#, "logit_bias"),
            (Api::Chat, many.as_str(), "logit_bias"),
        ] {
            let e = sampling_params(&fields(json), api, 1, 9).unwrap_err();
            assert_eq!(e.status, 400, "{json}");
            assert_eq!(e.param.as_deref(), Some(param), "{json}");
        }
    }

    #[test]
    fn defaults_fill_the_window() {
        let p = sampling_params_chat(&fields("{}"), 100, 1000).unwrap();
        assert_eq!(p.max_tokens, 900);
        assert_eq!(p.temperature, 1.0);
    }

    #[test]
    fn bad_values_name_their_field() {
        for (json, param) in [
            (r#"{"max_tokens": -1}"#, "max_tokens"),
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"temperature": 3}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": -5}"#, "top_k"),
            (r#"{"stop": ["a", "b", "c", "d", "e"]}"#, "stop"),
            (r#"{"stop": ["", "", "", "", ""]}"#, "stop"),
        ] {
            let e = sampling_params_chat(&fields(json), 10, 100).unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{json}");
        }
    }

    #[test]
    fn stop_strings_are_bounded_in_count_and_bytes() {
        use kvfleet_core::openai::{MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES};
        let at_bound = serde_json::json!({
            "stop": vec!["x".repeat(MAX_STOP_STRING_BYTES); MAX_STOP_STRINGS]
        });
        let p = sampling_params_chat(&fields(&at_bound.to_string()), 10, 100).unwrap();
        assert_eq!(p.stop.len(), MAX_STOP_STRINGS);
        let long = serde_json::json!({"stop": "é".repeat(MAX_STOP_STRING_BYTES / 2 + 1)});
        let e = sampling_params_chat(&fields(&long.to_string()), 10, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        assert!(e.message.contains("bytes"), "{}", e.message);
        // Empty strings are dropped after counting.
        let p = sampling_params_chat(&fields(r#"{"stop": ["", "z"]}"#), 10, 100).unwrap();
        assert_eq!(p.stop, vec!["z".to_string()]);
    }

    #[test]
    fn over_the_window_is_context_length_exceeded() {
        let e = sampling_params_chat(&fields(r#"{"max_tokens": 50}"#), 60, 100).unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        let e = sampling_params_chat(&fields("{}"), 100, 100).unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
    }
}
