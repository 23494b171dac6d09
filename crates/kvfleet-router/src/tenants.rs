//! API keys and the tenants they map to: the keys file, key hashing and lookup, and
//! each tenant's prefix-cache namespace.
//!
//! The keys file holds one key per line (a Kubernetes Secret mounted as a file works
//! the same way); `#` starts a comment:
//!
//! ```text
//! sha256:<64 hex digits> tenant=<name> [namespace=<shared name>] [admin]
//!     [max_concurrent=<n>] [tokens_per_minute=<n>]
//! ```
//!
//! Only the SHA-256 of a key is stored (`kvfleet keys hash` prints a line for a key
//! read from stdin). A request's key is hashed and compared against every entry in
//! constant time, so neither the stored hashes nor the lookup time leak which prefix
//! of a key matched.
//!
//! A tenant's prompts are cached in its own namespace: the namespace enters the
//! request's cache salt and therefore the block-hash seed, so one tenant can never be
//! served (or time) blocks computed from another tenant's prompt. Keys naming the same
//! `namespace=` share one namespace — opt-in sharing of, say, an organisation's system
//! prompt across its keys.

use sha2::{Digest, Sha256};
use std::collections::HashMap;

/// The tenant every request runs as when no keys file is configured.
pub const DEFAULT_TENANT: &str = "default";

/// Per-tenant admission limits (`None`: unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantLimits {
    /// Most requests of this tenant running at once.
    pub max_concurrent: Option<usize>,
    /// Token budget per minute (prompt tokens plus `max_tokens` of each request).
    pub tokens_per_minute: Option<u64>,
}

/// A tenant: who a key belongs to and what it may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    /// Tenant name (usage records carry it).
    pub name: String,
    /// Cache namespace: the tenant's own name unless it opted into a shared one.
    pub namespace: String,
    /// May read the operator endpoints (`/fleet`).
    pub admin: bool,
    /// Admission limits.
    pub limits: TenantLimits,
}

impl Tenant {
    /// The tenant of an unauthenticated router: today's behaviour, no namespace.
    pub fn default_tenant(limits: TenantLimits) -> Tenant {
        Tenant {
            name: DEFAULT_TENANT.to_string(),
            namespace: String::new(),
            admin: true,
            limits,
        }
    }
}

/// The cache salt a tenant's request is hashed under (router and worker alike: the
/// worker receives this string as the request's `cache_salt`).
///
/// An empty namespace (auth off) leaves the client's salt unchanged. Otherwise the
/// namespace is length-prefixed, so `(namespace, salt)` pairs map to distinct strings
/// (`("ab", "c")` and `("a", "bc")` differ).
pub fn tenant_cache_salt(namespace: &str, cache_salt: &str) -> String {
    if namespace.is_empty() {
        return cache_salt.to_string();
    }
    format!("tenant:{}:{namespace}:{cache_salt}", namespace.len())
}

/// SHA-256 of an API key, as stored in the keys file (`sha256:<hex>`).
pub fn hash_key(key: &str) -> String {
    format!("sha256:{}", hex(&Sha256::digest(key.as_bytes())))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Equality of two digests without an early exit.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The configured keys.
#[derive(Clone, Debug, Default)]
pub struct KeyRing {
    entries: Vec<([u8; 32], Tenant)>,
}

/// A keys file that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("keys file line {line}: {message}")]
pub struct KeysFileError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

impl KeyRing {
    /// Parses a keys file's text (format in the module docs).
    pub fn parse(text: &str) -> Result<KeyRing, KeysFileError> {
        let mut entries: Vec<([u8; 32], Tenant)> = Vec::new();
        // Limits and flags belong to the tenant, so every key of a tenant must agree.
        let mut seen: HashMap<String, Tenant> = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let err = |message: String| KeysFileError {
                line: i + 1,
                message,
            };
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let hash = words
                .next()
                .and_then(|w| w.strip_prefix("sha256:"))
                .and_then(parse_hex32)
                .ok_or_else(|| err("expected `sha256:<64 hex digits>` first".into()))?;
            let mut name = None;
            let mut namespace = None;
            let mut admin = false;
            let mut limits = TenantLimits::default();
            for w in words {
                let (k, v) = w.split_once('=').unwrap_or((w, ""));
                let number = |v: &str| {
                    v.parse::<u64>()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| err(format!("`{k}` wants a positive integer")))
                };
                match k {
                    "tenant" if !v.is_empty() => name = Some(v.to_string()),
                    "namespace" if !v.is_empty() => namespace = Some(v.to_string()),
                    "admin" if v.is_empty() || v == "true" => admin = true,
                    "max_concurrent" => limits.max_concurrent = Some(number(v)? as usize),
                    "tokens_per_minute" => limits.tokens_per_minute = Some(number(v)?),
                    _ => return Err(err(format!("unknown or empty field `{w}`"))),
                }
            }
            let name = name.ok_or_else(|| err("missing `tenant=<name>`".into()))?;
            let tenant = Tenant {
                namespace: namespace.unwrap_or_else(|| format!("tenant/{name}")),
                name: name.clone(),
                admin,
                limits,
            };
            if let Some(prev) = seen.get(&name) {
                if *prev != tenant {
                    return Err(err(format!(
                        "tenant `{name}` is configured differently on another line"
                    )));
                }
            }
            if entries.iter().any(|(h, _)| h == &hash) {
                return Err(err("duplicate key".into()));
            }
            seen.insert(name, tenant.clone());
            entries.push((hash, tenant));
        }
        if entries.is_empty() {
            return Err(KeysFileError {
                line: 0,
                message: "the keys file holds no key".into(),
            });
        }
        Ok(KeyRing { entries })
    }

    /// The tenant of `key`, if it is configured. Every entry is compared, in constant
    /// time, whatever matches.
    pub fn lookup(&self, key: &str) -> Option<&Tenant> {
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let mut found = None;
        for (hash, tenant) in &self.entries {
            if ct_eq(hash, &digest) && found.is_none() {
                found = Some(tenant);
            }
        }
        found
    }

    /// Every distinct tenant.
    pub fn tenants(&self) -> Vec<&Tenant> {
        let mut out: Vec<&Tenant> = Vec::new();
        for (_, t) in &self.entries {
            if !out.iter().any(|o| o.name == t.name) {
                out.push(t);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_matches_the_sha256_test_vector() {
        assert_eq!(
            hash_key("abc"),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn parses_keys_and_looks_them_up() {
        let text = format!(
            "# comment\n{} tenant=a max_concurrent=2 tokens_per_minute=1000\n\n{} tenant=b namespace=org admin\n{} tenant=c namespace=org\n",
            hash_key("key-a"),
            hash_key("key-b"),
            hash_key("key-c")
        );
        let ring = KeyRing::parse(&text).unwrap();
        let a = ring.lookup("key-a").unwrap();
        assert_eq!(a.name, "a");
        assert_eq!(a.namespace, "tenant/a");
        assert!(!a.admin);
        assert_eq!(a.limits.max_concurrent, Some(2));
        assert_eq!(a.limits.tokens_per_minute, Some(1000));
        let b = ring.lookup("key-b").unwrap();
        assert!(b.admin);
        assert_eq!(b.namespace, "org");
        assert_eq!(ring.lookup("key-c").unwrap().namespace, "org");
        assert!(ring.lookup("key-d").is_none());
        assert!(ring.lookup("").is_none());
        assert_eq!(ring.tenants().len(), 3);
    }

    #[test]
    fn rejects_bad_files() {
        let h = hash_key("k");
        for (text, line) in [
            ("sha256:zz tenant=a".to_string(), 1),
            (h.clone(), 1),
            (format!("{h} tenant=a colour=red"), 1),
            (format!("{h} tenant=a max_concurrent=0"), 1),
            (format!("{h} tenant=a\n{h} tenant=b"), 2),
            (
                format!("{h} tenant=a\n{} tenant=a admin", hash_key("k2")),
                2,
            ),
            ("# nothing\n".to_string(), 0),
        ] {
            let e = KeyRing::parse(&text).unwrap_err();
            assert_eq!(e.line, line, "{text}: {e}");
        }
    }

    #[test]
    fn tenant_salts_are_unambiguous() {
        assert_eq!(tenant_cache_salt("", "s"), "s");
        assert_ne!(tenant_cache_salt("ab", "c"), tenant_cache_salt("a", "bc"));
        assert_ne!(tenant_cache_salt("a:1", ""), tenant_cache_salt("a", "1:"));
        assert_ne!(tenant_cache_salt("t", ""), tenant_cache_salt("u", ""));
    }
}
