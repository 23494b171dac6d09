//! The OpenAI-compatible API surface the router owns: error bodies, sampling
//! validation, structured-output grammars, log-probability shapes and tool-call
//! parsing. The request/response bodies themselves are wire
//! format and live in `kvfleet_core::openai`.

pub mod error;
pub mod logprobs;
pub mod params;
pub mod structured;
pub mod tool_call_parser;
