"""`GET /openapi.json`: the server's routes and request bodies as OpenAPI 3.1, written by hand.

It says what the server accepts, as protocol.py and responses.py check it (the types and ranges; the fields OpenAI
defines that this server ignores are left out), so that a client generator or a property-based fuzzer
(tests/test_server_openapi.py, scripts/fuzz_openapi.py) can read it. Every route answers an OpenAI error object
for whatever it refuses.
"""

from __future__ import annotations

from deltaserve.api import __version__

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

_EFFORT = {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}
_THINKING = {  # a thinking budget (session/thinking.py): llama.cpp's and vLLM's names, -1 unlimited
    "reasoning_budget_tokens": {"type": "integer", "minimum": -1},
    "thinking_token_budget": {"type": "integer", "minimum": -1},
    "reasoning_budget_message": {"type": "string", "maxLength": 1000},
}

_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": 9223372036854775807},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 10},
    "user": {"type": "string"},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": 256},
    "response_format": {"type": "object", "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                         "strict": {"type": "boolean"}}}}},
    "reasoning_effort": _EFFORT,
    **_THINKING,
}

_CONTENT = {"oneOf": [
    {"type": "string"},
    {"type": "array", "items": {"oneOf": [
        {"type": "object", "required": ["type", "text"],
         "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
        {"type": "object", "required": ["type", "image_url"],
         "properties": {"type": {"const": "image_url"}, "image_url": {
             "type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}}}}]}}]}

_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}

_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": _CONTENT,
    "reasoning_content": {"type": "string"},
    "name": {"type": "string"},
    "tool_call_id": {"type": "string"},
    "tool_calls": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 200}, "arguments": {"type": "string"}}}}}}}}

CHAT = {"type": "object", "required": ["messages"], "properties": {
    **_SAMPLING,
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 8},
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "tools": {"type": "array", "items": _TOOL},
    "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]}, {"type": "object"}]},
    "parallel_tool_calls": {"type": "boolean"},
    "chat_template_kwargs": {"type": "object", "properties": {"enable_thinking": {"type": "boolean"}}},
}}

COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    **_SAMPLING,
    "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
    "n": {"type": "integer", "minimum": 1, "maximum": 8},
    "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "echo": {"type": "boolean"},
}}

_INPUT_ITEM = {"type": "object", "properties": {
    "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]},
    "role": {"enum": ["user", "system", "developer", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "properties": {
        "type": {"enum": ["input_text", "output_text", "input_image"]}, "text": {"type": "string"},
        "image_url": {"type": "string"}}}}]},
    "call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"},
    "output": {"type": "string"}}}

RESPONSES = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string"},
    "input": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": _INPUT_ITEM}]},
    "instructions": {"type": "string"},
    "max_output_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": 9223372036854775807},
    "previous_response_id": {"type": "string", "pattern": "^resp_[0-9a-f]{32}$"},
    "store": {"type": "boolean"},
    "stream": {"type": "boolean"},
    "metadata": {"type": "object", "maxProperties": 16,
                 "additionalProperties": {"type": "string", "maxLength": 512}},
    "user": {"type": "string"},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": 256},
    "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "parameters": {"type": "object"}}}},
    "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]}, {"type": "object"}]},
    "parallel_tool_calls": {"type": "boolean"},
    "reasoning": {"type": "object", "properties": {"effort": _EFFORT}},
    **_THINKING,
    "text": {"type": "object", "properties": {"format": {"type": "object"}}},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "include": {"type": "array", "items": {"const": "message.output_text.logprobs"}},
}}

_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "image", "tool_use", "tool_result", "thinking"]}, "text": {"type": "string"},
    "source": {"type": "object", "properties": {"type": {"enum": ["base64", "url"]}, "media_type": {"type": "string"},
                                                "data": {"type": "string"}, "url": {"type": "string"}}},
    "id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"},
    "tool_use_id": {"type": "string"}, "content": {"type": "string"}, "thinking": {"type": "string"}}}

MESSAGES = {"type": "object", "required": ["messages", "max_tokens"], "properties": {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                                                           "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]}}}},
    "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "properties": {
        "type": {"const": "text"}, "text": {"type": "string"}}}}]},
    "stop_sequences": {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1}},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "stream": {"type": "boolean"},
    "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
    "tools": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "input_schema": {"type": "object"}}}},
    "tool_choice": {"type": "object", "properties": {"type": {"enum": ["auto", "any", "tool", "none"]},
                                                     "name": {"type": "string"},
                                                     "disable_parallel_tool_use": {"type": "boolean"}}},
    "thinking": {"type": "object", "properties": {"type": {"enum": ["enabled", "disabled", "adaptive"]},
                                                  "budget_tokens": {"type": "integer", "minimum": 0}}},
}}

TOKENIZE = {"type": "object", "required": ["content"], "properties": {
    "content": {"type": "string"}, "add_special": {"type": "boolean"}, "with_pieces": {"type": "boolean"}}}
DETOKENIZE = {"type": "object", "required": ["tokens"], "properties": {
    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}


def _answers(ok: str, *errors: int) -> dict:
    out = {"200": {"description": ok}}
    for status in errors:
        out[str(status)] = {"description": "an OpenAI error object",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return out


def _post(summary: str, schema: str) -> dict:
    return {"post": {"summary": summary, "security": [{"bearer": []}, {}],
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
                     "responses": _answers("the answer (a JSON object, or server-sent events with stream)",
                                           400, 401, 404, 408, 413, 415, 429, 503)}}


_RID = {"name": "rid", "in": "path", "required": True, "schema": {"type": "string"}}


def document(model_name: str = "deltaserve") -> dict:
    """The OpenAPI 3.1 document of this server (its served model named in the description)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "deltaserve", "version": __version__,
                 "description": f"An OpenAI-compatible server of {model_name} on resident sessions."},
        "servers": [{"url": "/"}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": _ERROR, "ChatCompletionRequest": CHAT, "CompletionRequest": COMPLETION,
                        "ResponsesRequest": RESPONSES, "MessagesRequest": MESSAGES, "TokenizeRequest": TOKENIZE,
                        "DetokenizeRequest": DETOKENIZE},
        },
        "paths": {
            "/v1/chat/completions": _post("a chat turn", "ChatCompletionRequest"),
            "/v1/completions": _post("a completion of raw text or token ids", "CompletionRequest"),
            "/v1/responses": _post("a Responses API turn", "ResponsesRequest"),
            "/v1/messages": _post("an Anthropic Messages API turn (errors in Anthropic's shape)", "MessagesRequest"),
            "/v1/messages/count_tokens": _post("the prompt's tokens of a Messages request", "MessagesRequest"),
            "/tokenize": _post("text as token ids (llama-server's, vLLM's)", "TokenizeRequest"),
            "/detokenize": _post("token ids as text", "DetokenizeRequest"),
            "/tokenizer_info": {"get": {"summary": "the special tokens, the chat template, the context",
                                        "responses": _answers("the tokenizer's facts", 401)}},
            "/v1/responses/{rid}": {
                "get": {"summary": "a stored response", "parameters": [_RID],
                        "responses": _answers("the response object", 401, 404)},
                "delete": {"summary": "delete a stored response", "parameters": [_RID],
                           "responses": _answers("deleted", 401, 404)}},
            "/v1/responses/{rid}/input_items": {
                "get": {"summary": "a stored response's input items", "parameters": [
                    _RID, {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                    {"name": "after", "in": "query", "schema": {"type": "string"}}],
                        "responses": _answers("a list of items", 400, 401, 404)}},
            "/v1/models": {"get": {"summary": "the served model", "responses": _answers("a list", 401)}},
            "/v1/models/{model_id}": {"get": {
                "summary": "one model", "parameters": [{"name": "model_id", "in": "path", "required": True,
                                                        "schema": {"type": "string"}}],
                "responses": _answers("a model", 401, 404)}},
            "/health": {"get": {"summary": "liveness (details with the key)", "responses": _answers("up", 401)}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": _answers("metrics", 401)}},
            "/openapi.json": {"get": {"summary": "this document", "responses": _answers("the document")}},
        },
    }
