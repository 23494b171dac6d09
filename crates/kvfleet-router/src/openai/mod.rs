//! The OpenAI-compatible API surface: request/response bodies, error bodies, sampling
//! validation and tool-call parsing.

pub mod error;
pub mod params;
pub mod tool_call_parser;
pub mod types;
