//! `--cache-aware-config`: the `cache-aware` policy's weights from JSON, one flag
//! for `kvfleet router`, `kvfleet up`, `kvfleet sim` and `kvfleet bench sweep`.
//!
//! The value is a JSON object, inline (`'{"idle_prefill_weight": 1.2}'`) or in a file
//! (any value not starting with `{` or `[` is a path). Its fields are those of
//! [`CacheAwareConfig`]; a field left out keeps its default. Tier pricing (`tiers`)
//! and the pull trigger (`pull_trigger`) are refused here: they have their own flags
//! (`--peer-pull-*`, `--*-bandwidth-gbs`) or come from the cost model, and one setting
//! with two sources would leave the reader guessing which won. Everything is checked
//! when the flag is parsed, before a model loads: an unknown field, a wrong type or
//! a negative weight stops the command with a message naming it.

use kvfleet_routing::policy::CacheAwareConfig;
use serde_json::{Map, Value};

/// Fields of [`CacheAwareConfig`] set by their own flags rather than by this one.
const FLAG_FIELDS: [(&str, &str); 2] = [
    (
        "tiers",
        "tier pricing comes from --peer-pull-min-blocks, --peer-bandwidth-gbs, \
         --host-bandwidth-gbs, --disk-bandwidth-gbs and --prefill-tokens-per-s (the \
         cost model's figures in the simulators)",
    ),
    ("pull_trigger", "use --peer-pull-trigger"),
];

/// Weights given with `--cache-aware-config`, checked, to lay over a base
/// configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheAwareOverrides(Map<String, Value>);

impl CacheAwareOverrides {
    /// `base` with these weights laid over it: the fields given here replace base's,
    /// the others (tiers and pull trigger among them) stay.
    pub fn apply(&self, base: &CacheAwareConfig) -> Result<CacheAwareConfig, String> {
        let mut merged = match serde_json::to_value(base) {
            Ok(Value::Object(m)) => m,
            Ok(_) | Err(_) => return Err("cache-aware config does not serialize".into()),
        };
        merged.extend(self.0.clone());
        let config: CacheAwareConfig =
            serde_json::from_value(Value::Object(merged)).map_err(|e| e.to_string())?;
        config.validate()?;
        Ok(config)
    }
}

/// The JSON object of a flag that takes inline JSON or a file's path (`s` itself when
/// it starts with `{` or `[`, else the file `s` names); anything but an object is
/// refused, `what` naming what it should hold.
pub fn json_object(s: &str, what: &str) -> Result<Map<String, Value>, String> {
    let text = if s.trim_start().starts_with(['{', '[']) {
        s.to_string()
    } else {
        std::fs::read_to_string(s).map_err(|e| format!("reading {s:?}: {e}"))?
    };
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(format!("expected a JSON object of {what}")),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// Parses `--cache-aware-config`: inline JSON or a file's path (see the module docs).
pub fn parse_cache_aware_config(s: &str) -> Result<CacheAwareOverrides, String> {
    let fields = json_object(s, "cache-aware weights")?;
    if let Some((field, instead)) = FLAG_FIELDS.iter().find(|(f, _)| fields.contains_key(*f)) {
        return Err(format!("`{field}` is not set here: {instead}"));
    }
    let overrides = CacheAwareOverrides(fields);
    // Checks names, types and ranges now, before anything starts.
    overrides.apply(&CacheAwareConfig::default())?;
    Ok(overrides)
}

/// `base` with the weights of `--cache-aware-config` (if given) laid over it.
pub fn with_overrides(
    base: CacheAwareConfig,
    overrides: Option<&CacheAwareOverrides>,
) -> anyhow::Result<CacheAwareConfig> {
    match overrides {
        Some(o) => o
            .apply(&base)
            .map_err(|e| anyhow::anyhow!("--cache-aware-config: {e}")),
        None => Ok(base),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_routing::policy::PullTrigger;

    #[test]
    fn inline_weights_replace_only_the_fields_given() {
        let o = parse_cache_aware_config(r#"{"idle_prefill_weight": 1.2, "balance_slack": 8}"#)
            .expect("valid");
        let mut base = CacheAwareConfig::default();
        base.tiers.peer_pull_min_blocks = 16;
        base.pull_trigger = PullTrigger::Cost;
        let c = o.apply(&base).expect("applies");
        assert_eq!((c.idle_prefill_weight, c.balance_slack), (1.2, 8.0));
        assert_eq!(c.prefill_weight, base.prefill_weight);
        assert_eq!(c.tiers, base.tiers);
        assert_eq!(c.pull_trigger, PullTrigger::Cost);
    }

    #[test]
    fn a_file_holds_the_same_json() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("weights.json");
        std::fs::write(&path, r#"{ "wait_ending_ratio": 0.5 }"#).expect("write");
        let o = parse_cache_aware_config(path.to_str().expect("utf-8 path")).expect("valid");
        let c = with_overrides(CacheAwareConfig::default(), Some(&o)).expect("applies");
        assert_eq!(c.wait_ending_ratio, 0.5);
        let e = parse_cache_aware_config("/nonexistent/weights.json").expect_err("no file");
        assert!(e.contains("/nonexistent/weights.json"), "{e}");
    }

    #[test]
    fn bad_values_are_refused_with_the_field_named() {
        for (json, names) in [
            (r#"{"idle_weight": 1.2}"#, "idle_weight"),
            (r#"{"prefill_weight": "two"}"#, "invalid type"),
            (r#"{"memory_weight": -1}"#, "memory_weight"),
            (r#"{"tiers": {}}"#, "--peer-pull-min-blocks"),
            (r#"{"pull_trigger": "cost"}"#, "--peer-pull-trigger"),
            (r#"[1, 2]"#, "JSON object"),
            (r#"{"prefill_weight": 2"#, "not JSON"),
        ] {
            let e = parse_cache_aware_config(json).expect_err(json);
            assert!(e.contains(names), "{json}: {e}");
        }
    }
}
