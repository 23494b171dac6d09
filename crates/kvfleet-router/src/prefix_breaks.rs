//! Cache-break diagnostics: why a conversation's new turn lost the prefix cache of the
//! turn before it.
//!
//! A turn should extend the previous turn's prompt. When it diverges earlier — a
//! timestamp in the system prompt, reordered tools, an edited message — every block
//! after the divergence is recomputed and billed at full price. [`diagnose`] compares
//! the two turns' fingerprints and names the first diverging token, the message it
//! lies in and the likely cause, so an agent developer can find what broke the cache.

use kvfleet_core::chat::{to_canonical_json, ChatMessage, Role, ToolDefinition};
use kvfleet_core::TokenId;
use xxhash_rust::xxh3::xxh3_64;

/// What is remembered of one turn to compare the next one with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TurnFingerprint {
    /// Model id and cache salt: a different namespace shares no blocks.
    pub namespace: String,
    /// The turn's cacheable prompt ids (its messages, without a replaced status tail).
    pub tokens: Vec<TokenId>,
    /// Hash of each message, in order.
    pub message_hashes: Vec<u64>,
    /// Role of each message.
    pub message_roles: Vec<Role>,
    /// Hash of each tool definition, in order.
    pub tool_hashes: Vec<u64>,
}

impl TurnFingerprint {
    /// Heap bytes the fingerprint holds (what a memory bound counts).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.namespace.len()
            + self.tokens.len() * size_of::<TokenId>()
            + self.message_hashes.len() * size_of::<u64>()
            + self.message_roles.len() * size_of::<Role>()
            + self.tool_hashes.len() * size_of::<u64>()
    }

    /// The fingerprint of a turn rendering `messages` and `tools` into `tokens`.
    pub fn new(
        namespace: String,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
        tokens: Vec<TokenId>,
    ) -> Self {
        TurnFingerprint {
            namespace,
            tokens,
            message_hashes: messages.iter().map(hash_json).collect(),
            message_roles: messages.iter().map(|m| m.role).collect(),
            tool_hashes: tools.iter().map(hash_json).collect(),
        }
    }
}

fn hash_json<T: serde::Serialize>(v: &T) -> u64 {
    let text = serde_json::to_value(v)
        .map(|v| to_canonical_json(&v))
        .unwrap_or_default();
    xxh3_64(text.as_bytes())
}

/// The likely cause of a break.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BreakReason {
    /// Another model or cache salt: nothing can be shared.
    NamespaceChanged,
    /// The same tools in another order.
    ToolsReordered,
    /// Tools were added, removed or edited.
    ToolsChanged,
    /// The system prompt changed (often a timestamp or counter written into it).
    SystemPromptChanged,
    /// An earlier message was edited.
    MessageEdited,
    /// Earlier messages were removed (history truncated or summarized).
    HistoryTruncated,
    /// The messages extend the previous ones, but the rendered tokens do not (a chat
    /// template that rewrites earlier turns, e.g. stripping reasoning).
    TemplateRendering,
}

impl BreakReason {
    /// Every reason, for registering the metric's series before the first break.
    pub const ALL: [BreakReason; 7] = [
        BreakReason::NamespaceChanged,
        BreakReason::ToolsReordered,
        BreakReason::ToolsChanged,
        BreakReason::SystemPromptChanged,
        BreakReason::MessageEdited,
        BreakReason::HistoryTruncated,
        BreakReason::TemplateRendering,
    ];

    /// The metric label and header value.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakReason::NamespaceChanged => "namespace_changed",
            BreakReason::ToolsReordered => "tools_reordered",
            BreakReason::ToolsChanged => "tools_changed",
            BreakReason::SystemPromptChanged => "system_prompt_changed",
            BreakReason::MessageEdited => "message_edited",
            BreakReason::HistoryTruncated => "history_truncated",
            BreakReason::TemplateRendering => "template_rendering",
        }
    }
}

/// A turn that diverged from the previous one before that one's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixBreak {
    /// The likely cause.
    pub reason: BreakReason,
    /// First token position where the new prompt differs from the previous turn's.
    pub token: usize,
    /// The previous turn's cacheable length: what could have been reused.
    pub previous_tokens: usize,
    /// Index of the first message that differs; `None` when the tools differ or no
    /// message does.
    pub message: Option<usize>,
    /// That message's role in the new turn.
    pub role: Option<Role>,
}

impl PrefixBreak {
    /// The `x-kvfleet-prefix-break` header value:
    /// `reason=system_prompt_changed; token=12; message=0; role=system; previous_tokens=4096`.
    pub fn header_value(&self) -> String {
        let message = self
            .message
            .map_or_else(|| "none".to_string(), |i| i.to_string());
        let role = self.role.map_or("none", Role::as_str);
        format!(
            "reason={}; token={}; message={message}; role={role}; previous_tokens={}",
            self.reason.as_str(),
            self.token,
            self.previous_tokens
        )
    }
}

/// Compares a new turn with the previous one; `None` when the new turn's prompt starts
/// with the whole previous cacheable prompt (no cache was lost).
pub fn diagnose(prev: &TurnFingerprint, new: &TurnFingerprint) -> Option<PrefixBreak> {
    let token = prev
        .tokens
        .iter()
        .zip(&new.tokens)
        .take_while(|(a, b)| a == b)
        .count();
    if token == prev.tokens.len() && prev.namespace == new.namespace {
        return None;
    }
    let first_diff = prev
        .message_hashes
        .iter()
        .zip(&new.message_hashes)
        .position(|(a, b)| a != b);
    let (reason, message) = if prev.namespace != new.namespace {
        (BreakReason::NamespaceChanged, None)
    } else if prev.tool_hashes != new.tool_hashes {
        let mut a = prev.tool_hashes.clone();
        let mut b = new.tool_hashes.clone();
        a.sort_unstable();
        b.sort_unstable();
        let reason = if a == b {
            BreakReason::ToolsReordered
        } else {
            BreakReason::ToolsChanged
        };
        (reason, None)
    } else if let Some(i) = first_diff {
        let reason = if new.message_roles.get(i) == Some(&Role::System) {
            BreakReason::SystemPromptChanged
        } else {
            BreakReason::MessageEdited
        };
        (reason, Some(i))
    } else if new.message_hashes.len() < prev.message_hashes.len() {
        (
            BreakReason::HistoryTruncated,
            Some(new.message_hashes.len()),
        )
    } else {
        (BreakReason::TemplateRendering, None)
    };
    Some(PrefixBreak {
        reason,
        token,
        previous_tokens: prev.tokens.len(),
        message,
        role: message.and_then(|i| new.message_roles.get(i).copied()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::chat::FunctionDefinition;

    fn tool(name: &str) -> ToolDefinition {
        ToolDefinition {
            kind: "function".into(),
            function: FunctionDefinition {
                name: name.into(),
                description: None,
                parameters: None,
            },
        }
    }

    fn fp(messages: &[ChatMessage], tools: &[ToolDefinition], tokens: &[u32]) -> TurnFingerprint {
        TurnFingerprint::new("m\u{0}".into(), messages, tools, tokens.to_vec())
    }

    #[test]
    fn an_extended_turn_is_no_break() {
        let a = [ChatMessage::system("s"), ChatMessage::user("u")];
        let b = [
            ChatMessage::system("s"),
            ChatMessage::user("u"),
            ChatMessage::assistant("a"),
        ];
        assert_eq!(
            diagnose(&fp(&a, &[], &[1, 2, 3]), &fp(&b, &[], &[1, 2, 3, 4])),
            None
        );
    }

    #[test]
    fn a_changed_system_prompt_is_named() {
        let a = [ChatMessage::system("now: 10:00"), ChatMessage::user("u")];
        let b = [ChatMessage::system("now: 10:01"), ChatMessage::user("u")];
        let br = diagnose(&fp(&a, &[], &[1, 2, 3, 4]), &fp(&b, &[], &[1, 2, 9, 4])).unwrap();
        assert_eq!(br.reason, BreakReason::SystemPromptChanged);
        assert_eq!(
            (br.token, br.message, br.role),
            (2, Some(0), Some(Role::System))
        );
        assert_eq!(
            br.header_value(),
            "reason=system_prompt_changed; token=2; message=0; role=system; previous_tokens=4"
        );
    }

    #[test]
    fn reordered_and_changed_tools_are_told_apart() {
        let m = [ChatMessage::user("u")];
        let prev = fp(&m, &[tool("a"), tool("b")], &[1, 2, 3]);
        let reordered = fp(&m, &[tool("b"), tool("a")], &[1, 5, 3]);
        let changed = fp(&m, &[tool("a"), tool("c")], &[1, 2, 6]);
        assert_eq!(
            diagnose(&prev, &reordered).unwrap().reason,
            BreakReason::ToolsReordered
        );
        let br = diagnose(&prev, &changed).unwrap();
        assert_eq!(
            (br.reason, br.token, br.message),
            (BreakReason::ToolsChanged, 2, None)
        );
    }

    #[test]
    fn edits_truncation_and_namespace() {
        let a = [
            ChatMessage::system("s"),
            ChatMessage::user("u1"),
            ChatMessage::assistant("a1"),
        ];
        let edited = [
            ChatMessage::system("s"),
            ChatMessage::user("u2"),
            ChatMessage::assistant("a1"),
        ];
        let br = diagnose(&fp(&a, &[], &[1, 2, 3]), &fp(&edited, &[], &[1, 7, 3])).unwrap();
        assert_eq!(
            (br.reason, br.message, br.role),
            (BreakReason::MessageEdited, Some(1), Some(Role::User))
        );

        let truncated = [ChatMessage::system("s")];
        let br = diagnose(&fp(&a, &[], &[1, 2, 3]), &fp(&truncated, &[], &[1, 2])).unwrap();
        assert_eq!(
            (br.reason, br.message),
            (BreakReason::HistoryTruncated, Some(1))
        );

        let mut other = fp(&a, &[], &[1, 2, 3]);
        other.namespace = "m\u{0}tenant-b".into();
        assert_eq!(
            diagnose(&fp(&a, &[], &[1, 2, 3]), &other).unwrap().reason,
            BreakReason::NamespaceChanged
        );
    }

    #[test]
    fn same_messages_different_tokens_blame_the_template() {
        let a = [ChatMessage::user("u")];
        let br = diagnose(&fp(&a, &[], &[1, 2, 3]), &fp(&a, &[], &[1, 2, 4, 5])).unwrap();
        assert_eq!((br.reason, br.token), (BreakReason::TemplateRendering, 2));
    }
}
