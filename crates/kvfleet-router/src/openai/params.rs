//! Checking the sampling fields of a request and turning them into the worker's
//! sampling parameters; every bad value is a 400 naming the field.

use super::error::ApiError;
use kvfleet_core::openai::SamplingFields;
use kvfleet_proto::v1 as pb;

/// Validated sampling parameters for a prompt of `prompt_tokens` tokens on a model
/// with a `context` token window. `max_tokens` defaults to the rest of the window.
pub fn sampling_params(
    f: &SamplingFields,
    prompt_tokens: usize,
    context: usize,
) -> Result<pb::SamplingParams, ApiError> {
    if let Some(n) = f.n {
        if n != 1 {
            return Err(ApiError::invalid_param(
                "n",
                format!("n must be 1 (got {n})"),
            ));
        }
    }
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> SamplingFields {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn defaults_fill_the_window() {
        let p = sampling_params(&fields("{}"), 100, 1000).unwrap();
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
            (r#"{"n": 2}"#, "n"),
            (r#"{"top_k": -5}"#, "top_k"),
            (r#"{"stop": ["a", "b", "c", "d", "e"]}"#, "stop"),
            (r#"{"stop": ["", "", "", "", ""]}"#, "stop"),
        ] {
            let e = sampling_params(&fields(json), 10, 100).unwrap_err();
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
        let p = sampling_params(&fields(&at_bound.to_string()), 10, 100).unwrap();
        assert_eq!(p.stop.len(), MAX_STOP_STRINGS);
        let long = serde_json::json!({"stop": "é".repeat(MAX_STOP_STRING_BYTES / 2 + 1)});
        let e = sampling_params(&fields(&long.to_string()), 10, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        assert!(e.message.contains("bytes"), "{}", e.message);
        // Empty strings are dropped after counting.
        let p = sampling_params(&fields(r#"{"stop": ["", "z"]}"#), 10, 100).unwrap();
        assert_eq!(p.stop, vec!["z".to_string()]);
    }

    #[test]
    fn over_the_window_is_context_length_exceeded() {
        let e = sampling_params(&fields(r#"{"max_tokens": 50}"#), 60, 100).unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        let e = sampling_params(&fields("{}"), 100, 100).unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
    }
}
