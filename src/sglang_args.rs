//! `--sglang-config`: the SGLang baselines' settings for `kvfleet sim` and `kvfleet
//! bench sweep` (`sglang-cache-aware`, `sglang-spill`), a JSON object inline or in a
//! file as `--cache-aware-config` takes it. Fields left out keep SGLang's defaults;
//! an unknown field, a wrong type or a negative threshold stops the command with a
//! message naming it.

use kvfleet_bench::sim::sglang_cache_aware::SglangConfig;

/// Parses `--sglang-config`: inline JSON or a file's path.
pub fn parse_sglang_config(s: &str) -> Result<SglangConfig, String> {
    // An object only: serde would also fill the struct from an array, in field order.
    let fields = crate::cache_aware_args::json_object(s, "SGLang settings")?;
    let config: SglangConfig =
        serde_json::from_value(serde_json::Value::Object(fields)).map_err(|e| e.to_string())?;
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_left_out_keep_sglangs_defaults() {
        let c = parse_sglang_config(r#"{"idle_guard": true}"#).expect("valid");
        assert!(c.idle_guard);
        assert_eq!(
            SglangConfig {
                idle_guard: false,
                ..c
            },
            SglangConfig::default()
        );
    }

    #[test]
    fn unknown_fields_wrong_types_and_negative_thresholds_are_refused() {
        for (json, names) in [
            (r#"{"idle_gaurd": true}"#, "idle_gaurd"),
            (r#"{"spill": "yes"}"#, "invalid type"),
            (r#"{"cache_threshold": -0.1}"#, "cache_threshold"),
            ("[1]", "JSON object"),
            ("{", "not JSON"),
        ] {
            let e = parse_sglang_config(json).expect_err(json);
            assert!(e.contains(names), "{json}: {e}");
        }
        let e = parse_sglang_config("/nonexistent/sglang.json").expect_err("no file");
        assert!(e.contains("/nonexistent/sglang.json"), "{e}");
    }
}
