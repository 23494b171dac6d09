//! Security and admission flags of the serving commands (`up`, `router`) and the
//! `kvfleet keys` helper: API keys file, body and prompt limits, per-tenant and
//! router-wide admission limits.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use kvfleet_router::admission::{Admission, Limits};
use kvfleet_router::tenants::{hash_key, KeyRing, TenantLimits};
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// API keys and admission limits of a router (see docs/security.md).
#[derive(Args, Clone, Debug)]
pub struct SecurityArgs {
    /// Keys file (`sha256:<hex> tenant=<name> ...` per line; a mounted Kubernetes
    /// Secret works). Without it, auth is off and every request is tenant `default`.
    #[arg(long)]
    pub api_keys: Option<PathBuf>,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
    /// Most prompt tokens per request (400 `context_length_exceeded` beyond); default:
    /// the model's context.
    #[arg(long)]
    pub max_prompt_tokens: Option<usize>,
    /// Most tokens per completion: the default `max_tokens` and the largest accepted
    /// (400 beyond); default: the rest of the model's context.
    #[arg(long)]
    pub max_completion_tokens: Option<usize>,
    /// Requests running at once across all tenants.
    #[arg(long, default_value_t = 1024)]
    pub max_inflight: usize,
    /// Requests waiting for a running slot (429 at once beyond).
    #[arg(long, default_value_t = 4096)]
    pub max_queued: usize,
    /// Longest wait for a running slot, seconds (429 after).
    #[arg(long, default_value_t = 30.0)]
    pub queue_timeout_s: f64,
    /// Longest time (ms) a client may take to send a request's whole body (408 after).
    /// Bodies are read before admission: a stalled upload holds no running slot.
    #[arg(long, default_value_t = 30_000)]
    pub body_timeout_ms: u64,
    /// Default per-tenant limit on concurrent requests (a key's own limit wins).
    #[arg(long)]
    pub tenant_max_concurrent: Option<usize>,
    /// Default per-tenant tokens per minute (prompt + max_tokens; a key's own wins).
    #[arg(long)]
    pub tenant_tokens_per_minute: Option<u64>,
}

impl SecurityArgs {
    /// The admission gate these flags describe (reads the keys file).
    pub fn admission(&self) -> Result<Arc<Admission>> {
        let keys = match &self.api_keys {
            None => None,
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading keys file {}", p.display()))?;
                Some(KeyRing::parse(&text).with_context(|| format!("in {}", p.display()))?)
            }
        };
        anyhow::ensure!(
            self.queue_timeout_s.is_finite() && self.queue_timeout_s >= 0.0,
            "--queue-timeout-s must be a non-negative number"
        );
        let limits = Limits {
            max_body_bytes: self.max_body_bytes,
            max_prompt_tokens: self.max_prompt_tokens,
            max_completion_tokens: self.max_completion_tokens.filter(|n| *n > 0),
            max_inflight: self.max_inflight.max(1),
            max_queued: self.max_queued,
            queue_timeout: Duration::from_secs_f64(self.queue_timeout_s),
            body_timeout: Duration::from_millis(self.body_timeout_ms.max(1)),
            tenant_defaults: TenantLimits {
                max_concurrent: self.tenant_max_concurrent.filter(|n| *n > 0),
                tokens_per_minute: self.tenant_tokens_per_minute.filter(|n| *n > 0),
            },
        };
        Ok(Arc::new(Admission::new(limits, keys)))
    }
}

/// `kvfleet keys`.
#[derive(Args)]
pub struct KeysArgs {
    #[command(subcommand)]
    command: KeysCommand,
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Read an API key from stdin and print its keys-file line.
    Hash {
        /// Tenant the key belongs to.
        #[arg(long)]
        tenant: String,
        /// Shared cache namespace (keys naming the same one share prefix caches).
        #[arg(long)]
        namespace: Option<String>,
        /// May read `/fleet`.
        #[arg(long)]
        admin: bool,
    },
}

/// Runs `kvfleet keys`.
pub fn run(args: KeysArgs) -> Result<()> {
    match args.command {
        KeysCommand::Hash {
            tenant,
            namespace,
            admin,
        } => {
            let mut key = String::new();
            std::io::stdin()
                .read_to_string(&mut key)
                .context("reading the key from stdin")?;
            let key = key.trim_end_matches(['\n', '\r']);
            anyhow::ensure!(!key.is_empty(), "no key on stdin");
            anyhow::ensure!(
                !tenant.is_empty() && !tenant.contains(char::is_whitespace),
                "--tenant must be one word"
            );
            let mut line = format!("{} tenant={tenant}", hash_key(key));
            if let Some(ns) = namespace {
                line.push_str(&format!(" namespace={ns}"));
            }
            if admin {
                line.push_str(" admin");
            }
            println!("{line}");
            Ok(())
        }
    }
}
