"""The tokenizer over HTTP, as llama.cpp's server and vLLM have it (clients count tokens with it, and
lm-evaluation-harness tokenizes remotely with it when it finds /tokenizer_info and /tokenize):

- `POST /tokenize` {"content": text} (llama-server; vLLM's "prompt" too), `add_special` (or vLLM's
  `add_special_tokens`: this vocabulary has no BOS to add, so both are accepted and change nothing), `with_pieces`
  (each id with its text: a string, or its bytes where they are not whole UTF-8) -> {"tokens": [...], "count",
  "max_model_len"}. The text is tokenized as /v1/completions tokenizes a prompt: its special tokens' text is
  markup (`<|im_start|>` is one token), so the ids are the ones a completion of the same text is fed.
- `POST /detokenize` {"tokens": [ids]} -> {"content": text} (and vLLM's "prompt": the same text).
- `GET /tokenizer_info` (vLLM's): the special tokens, the chat template, the context.
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from deltaserve.frontends.server.protocol import bad
from deltaserve.session.driver import RenderedPrompt


def _flag(body: dict, *names: str) -> bool:
    for name in names:
        if body.get(name) is not None:
            if not isinstance(body[name], bool):
                raise bad(f"'{name}' must be a boolean, got {type(body[name]).__name__}", name)
            return body[name]
    return False


def tokenize(tokenizer, body, context: int) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object with 'content' (the text to tokenize)")
    key = "content" if "content" in body else "prompt"
    text = body.get(key)
    if not isinstance(text, str):
        raise bad(f"'content' must be a string (the text to tokenize), got {type(text).__name__}", key)
    _flag(body, "add_special", "add_special_tokens")  # checked: no BOS in this vocabulary, nothing to add
    pieces = _flag(body, "with_pieces")
    try:
        ids = RenderedPrompt(text).encode(tokenizer)
    except ValueError as e:  # text the tokenizer refuses (a lone surrogate): its own words
        raise bad(str(e)[:300], key) from None
    out: dict = {"count": len(ids), "max_model_len": context}
    if pieces:
        tokens = []
        for i in ids:
            b = tokenizer.token_bytes(i)
            try:
                piece: str | list[int] = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)  # part of a character: its bytes, as llama-server gives them
            tokens.append({"id": i, "piece": piece})
        out["tokens"] = tokens
    else:
        out["tokens"] = ids
    return out


def detokenize(tokenizer, body, vocab: int) -> dict:
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise bad("'tokens' must be a list of token ids", "tokens")
    wrong = [i for i in ids if not 0 <= i < vocab]
    if wrong:
        raise bad(f"'tokens' holds {len(wrong)} id(s) outside 0..{vocab - 1} (the first: {wrong[0]})", "tokens")
    text = tokenizer.decode(ids)
    return {"content": text, "prompt": text}


def add_routes(app, server) -> None:
    """The tokenizer's routes (behind the API key, as every route that reads the model)."""
    tok = server.model.tokenizer

    async def body_of(request: Request):
        server.check_json(request)
        return await server.read_json(request)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        server.check_auth(request)
        body = await body_of(request)
        return await asyncio.get_running_loop().run_in_executor(server.text_pool, tokenize, tok, body, server.context)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        server.check_auth(request)
        body = await body_of(request)
        return await asyncio.get_running_loop().run_in_executor(server.text_pool, detokenize, tok, body,
                                                                server.model.config.vocab_size)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        server.check_auth(request)
        name = lambda i: tok.id_to_token(i) if i is not None else None  # noqa: E731
        eos = sorted(server.model.config.eos_token_ids or tok.stop_ids)
        return {"tokenizer_class": "deltaserve", "eos_token": name(eos[0]) if eos else None, "bos_token": None,
                "pad_token": None, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": server.context, "vocab_size": server.model.config.vocab_size}

