//! `GET /openapi.json`: the OpenAPI 3.0 document of every route the router serves
//! ([`super::ROUTES`]; a test keeps the two in step), for client generators and API
//! fuzzers such as schemathesis.

use crate::fleet::Fleet;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;

/// `GET /openapi.json`.
pub async fn serve(State(fleet): State<Arc<Fleet>>) -> Json<Value> {
    Json(document(fleet.model().map(|m| m.0).as_deref()))
}

fn error_responses() -> Value {
    let e = json!({
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    });
    let mut r = serde_json::Map::new();
    for (code, why) in [
        ("400", "Invalid request"),
        ("401", "Missing or unknown API key"),
        ("404", "Unknown model"),
        ("413", "Request body too large"),
        (
            "429",
            "Rate, concurrency or queue limit reached (see Retry-After)",
        ),
        ("503", "No worker can take the request"),
    ] {
        let mut v = e.clone();
        v["description"] = json!(why);
        r.insert(code.to_string(), v);
    }
    Value::Object(r)
}

fn with_errors(ok: Value) -> Value {
    let mut r = error_responses();
    if let (Value::Object(r), Value::Object(ok)) = (&mut r, ok) {
        r.extend(ok);
    }
    r
}

fn json_body(schema: &str) -> Value {
    json!({
        "required": true,
        "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}
    })
}

fn ok_json(schema: &str, description: &str) -> Value {
    json!({"200": {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}
    }})
}

fn ok_json_or_stream(schema: &str) -> Value {
    json!({"200": {
        "description": "The completion (JSON), or server-sent events when `stream` is true",
        "content": {
            "application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}},
            "text/event-stream": {"schema": {"type": "string"}}
        }
    }})
}

/// `/v1/messages`' responses: errors in Anthropic's shape.
fn anthropic_responses() -> Value {
    let mut r = error_responses();
    if let Value::Object(m) = &mut r {
        for v in m.values_mut() {
            v["content"]["application/json"]["schema"]["$ref"] =
                json!("#/components/schemas/AnthropicError");
        }
    }
    let ok = json!({"200": {
        "description": "The message (JSON), or Anthropic's server-sent events when `stream` is true",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/MessagesResponse"}},
            "text/event-stream": {"schema": {"type": "string"}}
        }
    }});
    if let (Value::Object(r), Value::Object(ok)) = (&mut r, ok) {
        r.extend(ok);
    }
    r
}

/// The Messages request body; unknown fields are refused, as the schema says.
fn messages_request(model_schema: Value) -> Value {
    let cache_control = json!({"type": "object", "additionalProperties": false,
    "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["ephemeral"]},
        "ttl": {"type": "string", "enum": ["5m", "1h"]}
    }});
    let text_block = json!({"type": "object", "additionalProperties": false,
    "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["text"]},
        "text": {"type": "string"},
        "cache_control": cache_control
    }});
    let block = json!({"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "tool_use", "tool_result"]},
        "text": {"type": "string"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
        "tool_use_id": {"type": "string"},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": text_block}]},
        "is_error": {"type": "boolean"},
        "cache_control": cache_control
    }});
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["model", "max_tokens", "messages"],
        "properties": {
            "model": model_schema,
            "max_tokens": {"type": "integer", "minimum": 1, "example": 16},
            "messages": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": false,
                "required": ["role", "content"], "properties": {
                    "role": {"type": "string", "enum": ["user", "assistant"]},
                    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": block}]}
                }}},
            "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": text_block}]},
            "tools": {"type": "array", "items": {"type": "object", "additionalProperties": false,
                "required": ["name", "input_schema"], "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "input_schema": {"type": "object"},
                    "cache_control": cache_control
                }}},
            "tool_choice": {"type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
                "name": {"type": "string"}
            }},
            "stop_sequences": {"type": "array", "maxItems": 4,
                "items": {"type": "string", "maxLength": 64}},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "exclusiveMinimum": true, "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer"},
            "metadata": {"type": "object", "additionalProperties": false, "properties": {
                "user_id": {"type": "string", "nullable": true}
            }},
            "stream": {"type": "boolean"},
            "cache_control": cache_control,
            "cache_salt": {"type": "string", "nullable": true}
        }
    })
}

fn sampling_properties() -> Value {
    json!({
        "max_tokens": {"type": "integer", "minimum": 1, "nullable": true, "example": 16},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": true},
        "temperature": {"type": "number", "minimum": 0, "nullable": true},
        "top_p": {"type": "number", "exclusiveMinimum": true, "minimum": 0, "maximum": 1, "nullable": true},
        "top_k": {"type": "integer", "nullable": true},
        "seed": {"type": "integer", "nullable": true},
        // 64 characters are at most 256 bytes: whatever the schema allows is served.
        "stop": {"nullable": true,
            "description": "Up to 4 stop strings of at most 256 bytes (UTF-8) each",
            "oneOf": [
                {"type": "string", "maxLength": 64},
                {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 64}}
            ]},
        "n": {"type": "integer", "minimum": 1, "maximum": crate::openai::params::MAX_N, "nullable": true},
        "ignore_eos": {"type": "boolean"},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "nullable": true, "properties": {
            "include_usage": {"type": "boolean"}
        }},
        "cache_salt": {"type": "string", "nullable": true,
            "description": "Cache namespace within the tenant's: prefixes are shared only within one salt"},
        "user": {"type": "string", "nullable": true},
        "response_format": {"type": "object", "nullable": true, "required": ["type"],
            "description": "Structured output by constrained decoding (llguidance): any JSON object, or JSON valid against a schema",
            "properties": {
                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                "json_schema": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "schema": {"type": "object"},
                    "strict": {"type": "boolean", "nullable": true}
                }}
            }},
        "logprobs": {"nullable": true,
            "description": "Chat: true for per-token log-probabilities; completions: alternatives per token (0..=5)",
            "oneOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 5}]},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": true},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": true},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": true},
        "logit_bias": {"type": "object", "nullable": true, "maxProperties": 300,
            "description": "Token id (as a string) to a bias added to its logit",
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}
    })
}

fn merged(base: Value, extra: Value) -> Value {
    let mut out = base;
    if let (Value::Object(o), Value::Object(e)) = (&mut out, extra) {
        o.extend(e);
    }
    out
}

/// The OpenAPI document; `model` (the served model, once a worker joined) is given as
/// the example of every `model` field, so example requests reach a worker.
pub fn document(model: Option<&str>) -> Value {
    let model_schema = match model {
        Some(m) => json!({"type": "string", "example": m}),
        None => json!({"type": "string"}),
    };
    let message = json!({
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"nullable": true, "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object", "properties": {
                    "type": {"type": "string"}, "text": {"type": "string"}
                }}}
            ]},
            "tool_calls": {"type": "array", "items": {"$ref": "#/components/schemas/ToolCall"}},
            "tool_call_id": {"type": "string"},
            "name": {"type": "string"}
        }
    });
    let usage = json!({
        "type": "object",
        "properties": {
            "prompt_tokens": {"type": "integer"},
            "completion_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
            "prompt_tokens_details": {"type": "object", "properties": {
                "cached_tokens": {"type": "integer"}
            }}
        }
    });
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "kvfleet router",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "OpenAI-compatible API of a kvfleet router, plus its operator endpoints. \
                With a keys file, /v1/* needs an API key and /fleet an admin key; \
                /health, /metrics and /openapi.json stay open."
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {
                        "type": "object",
                        "required": ["message", "type"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": "string", "nullable": true},
                            "code": {"type": "string", "nullable": true}
                        }
                    }}
                },
                "ToolCall": {
                    "type": "object",
                    "required": ["id", "type", "function"],
                    "properties": {
                        "id": {"type": "string"},
                        "type": {"type": "string", "enum": ["function"]},
                        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                            "name": {"type": "string"}, "arguments": {"type": "string"}
                        }}
                    }
                },
                "Tool": {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"type": "string", "enum": ["function"]},
                        "function": {"type": "object", "required": ["name"], "properties": {
                            "name": {"type": "string"},
                            "description": {"type": "string"},
                            "parameters": {"type": "object"}
                        }}
                    }
                },
                "ChatMessage": message,
                "Usage": usage,
                "ChatCompletionRequest": {
                    "type": "object",
                    // An unknown top-level field is a 400 naming it.
                    "additionalProperties": false,
                    "required": ["model", "messages"],
                    "properties": merged(sampling_properties(), json!({
                        "model": model_schema.clone(),
                        "messages": {"type": "array", "minItems": 1,
                            "items": {"$ref": "#/components/schemas/ChatMessage"}},
                        "tools": {"type": "array", "nullable": true,
                            "items": {"$ref": "#/components/schemas/Tool"}},
                        "tool_choice": {"nullable": true,
                            "description": "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}; the last two constrain the output to a tool call"},
                        "agent_status": {"type": "object", "nullable": true},
                        "status_mode": {"type": "string", "enum": ["replace", "append"], "nullable": true},
                        "status_fields": {"type": "array", "nullable": true, "items": {"type": "string"}},
                        "tool_call_limits": {"type": "object", "nullable": true}
                    }))
                },
                "ChatCompletion": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"type": "string"},
                        "created": {"type": "integer"},
                        "model": {"type": "string"},
                        "choices": {"type": "array", "items": {"type": "object", "properties": {
                            "index": {"type": "integer"},
                            "message": {"$ref": "#/components/schemas/ChatMessage"},
                            "finish_reason": {"type": "string", "nullable": true}
                        }}},
                        "usage": {"$ref": "#/components/schemas/Usage"}
                    }
                },
                "CompletionRequest": {
                    "type": "object",
                    // An unknown top-level field is a 400 naming it.
                    "additionalProperties": false,
                    "required": ["model", "prompt"],
                    "properties": merged(sampling_properties(), json!({
                        "model": model_schema.clone(),
                        "prompt": {"oneOf": [
                            {"type": "string"},
                            {"type": "array", "items": {"type": "integer", "minimum": 0}},
                            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                            {"type": "array", "minItems": 1, "maxItems": 1,
                                "items": {"type": "array", "items": {"type": "integer", "minimum": 0}}}
                        ]},
                        "echo": {"type": "boolean", "enum": [false]}
                    }))
                },
                "Completion": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"type": "string"},
                        "created": {"type": "integer"},
                        "model": {"type": "string"},
                        "choices": {"type": "array", "items": {"type": "object", "properties": {
                            "index": {"type": "integer"},
                            "text": {"type": "string"},
                            "finish_reason": {"type": "string", "nullable": true}
                        }}},
                        "usage": {"$ref": "#/components/schemas/Usage"}
                    }
                },
                "ForkRequest": {
                    "type": "object",
                    // An unknown top-level field is a 400 naming it.
                    "additionalProperties": false,
                    "required": ["model", "messages", "directives"],
                    "properties": merged(sampling_properties(), json!({
                        "model": model_schema,
                        "messages": {"type": "array", "minItems": 1,
                            "items": {"$ref": "#/components/schemas/ChatMessage"}},
                        "tools": {"type": "array", "nullable": true,
                            "items": {"$ref": "#/components/schemas/Tool"}},
                        "directives": {"type": "array", "minItems": 1, "maxItems": super::forks::MAX_DIRECTIVES,
                            "items": {"type": "string"}},
                        "placeholder": {"type": "string", "nullable": true}
                    }))
                },
                "ForkResponse": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"type": "string"},
                        "model": {"type": "string"},
                        "choices": {"type": "array", "items": {"type": "object"}},
                        "usage": {"$ref": "#/components/schemas/Usage"}
                    }
                },
                "AnthropicError": {
                    "type": "object",
                    "required": ["type", "error"],
                    "properties": {
                        "type": {"type": "string", "enum": ["error"]},
                        "error": {"type": "object", "required": ["type", "message"], "properties": {
                            "type": {"type": "string"},
                            "message": {"type": "string"}
                        }}
                    }
                },
                "MessagesRequest": messages_request(model_schema.clone()),
                "MessagesResponse": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "type": {"type": "string", "enum": ["message"]},
                        "role": {"type": "string", "enum": ["assistant"]},
                        "model": {"type": "string"},
                        "content": {"type": "array", "items": {"type": "object"}},
                        "stop_reason": {"type": "string", "nullable": true},
                        "stop_sequence": {"type": "string", "nullable": true},
                        "usage": {"type": "object", "properties": {
                            "input_tokens": {"type": "integer"},
                            "output_tokens": {"type": "integer"},
                            "cache_creation_input_tokens": {"type": "integer"},
                            "cache_read_input_tokens": {"type": "integer"}
                        }}
                    }
                },
                "ModelList": {
                    "type": "object",
                    "properties": {
                        "object": {"type": "string"},
                        "data": {"type": "array", "items": {"type": "object", "properties": {
                            "id": {"type": "string"},
                            "object": {"type": "string"},
                            "created": {"type": "integer"},
                            "owned_by": {"type": "string"},
                            "max_model_len": {"type": "integer"}
                        }}}
                    }
                }
            }
        },
        "security": [{"bearer": []}, {"apiKey": []}, {}],
        "paths": {
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion",
                "requestBody": json_body("ChatCompletionRequest"),
                "responses": with_errors(ok_json_or_stream("ChatCompletion"))
            }},
            "/v1/completions": {"post": {
                "operationId": "createCompletion",
                "requestBody": json_body("CompletionRequest"),
                "responses": with_errors(ok_json_or_stream("Completion"))
            }},
            "/v1/messages": {"post": {
                "operationId": "createMessage",
                "description": "Anthropic's Messages API, with cache_control breakpoints; errors in Anthropic's shape",
                "requestBody": json_body("MessagesRequest"),
                "responses": anthropic_responses()
            }},
            "/v1/forks": {"post": {
                "operationId": "createForks",
                "description": "One parent conversation forked into one child per directive, sharing its prefix",
                "requestBody": json_body("ForkRequest"),
                "responses": with_errors(ok_json("ForkResponse", "Every child's answer"))
            }},
            "/v1/models": {"get": {
                "operationId": "listModels",
                "responses": with_errors(ok_json("ModelList", "The served model"))
            }},
            "/health": {"get": {
                "operationId": "health",
                "security": [],
                "responses": {
                    "200": {"description": "At least one worker can be routed to",
                        "content": {"application/json": {"schema": {"type": "object"}}}},
                    "503": {"description": "No healthy worker",
                        "content": {"application/json": {"schema": {"type": "object"}}}}
                }
            }},
            "/metrics": {"get": {
                "operationId": "metrics",
                "security": [],
                "responses": {"200": {"description": "Prometheus text exposition",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}
            }},
            "/fleet": {"get": {
                "operationId": "fleetState",
                "description": "Workers, load, index and recent routing decisions (admin key when keys are configured)",
                "responses": {
                    "200": {"description": "The fleet state",
                        "content": {"application/json": {"schema": {"type": "object"}}}},
                    "401": {"description": "Missing or unknown API key",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
                    "403": {"description": "Not an admin key",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
                }
            }},
            "/dashboard": {"get": {
                "operationId": "dashboardPage",
                "security": [],
                "description": "The live cache map (HTML; it polls /dashboard/state)",
                "responses": {"200": {"description": "The page",
                    "content": {"text/html": {"schema": {"type": "string"}}}}}
            }},
            "/dashboard/state": {"get": {
                "operationId": "dashboardState",
                "description": "The live cache map's snapshot: totals, workers, prefix groups x workers, recent decisions (admin key when keys are configured)",
                "parameters": [{"name": "decisions", "in": "query", "required": false,
                    "schema": {"type": "integer", "minimum": 0, "maximum": 256}}],
                "responses": {
                    "200": {"description": "The snapshot",
                        "content": {"application/json": {"schema": {"type": "object"}}}},
                    "401": {"description": "Missing or unknown API key",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
                    "403": {"description": "Not an admin key",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
                }
            }},
            "/openapi.json": {"get": {
                "operationId": "openapi",
                "security": [],
                "responses": {"200": {"description": "This document",
                    "content": {"application/json": {"schema": {"type": "object"}}}}}
            }}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_is_documented_and_nothing_else() {
        let doc = document(Some("tiny"));
        let paths = doc["paths"].as_object().unwrap();
        for (method, path) in super::super::ROUTES {
            assert!(
                paths.get(*path).and_then(|p| p.get(*method)).is_some(),
                "{method} {path} is served but not in /openapi.json"
            );
        }
        let documented: usize = paths.values().map(|p| p.as_object().unwrap().len()).sum();
        assert_eq!(documented, super::super::ROUTES.len());
    }

    #[test]
    fn every_reference_resolves() {
        let doc = document(Some("tiny"));
        let text = doc.to_string();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        let mut refs = 0;
        for part in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
            let name = part.split('"').next().unwrap();
            assert!(schemas.contains_key(name), "dangling $ref {name}");
            refs += 1;
        }
        assert!(refs > 10);
    }
}
