"""``/tokenize`` and ``/detokenize`` (vLLM's extra routes): the served model's tokenizer over HTTP."""

from __future__ import annotations

from typing import Any

from quart import Response
from quart_trio import QuartTrio

from gateway.api.context import app_state, authorize, check_model
from gateway.api.http_json import json_response, read_json
from gateway.base.errors import bad_request
from gateway.pipeline.protocol import check_fields, parse_chat
from gateway.pipeline.tokenizer import ChatTemplateError, InvalidText


def register(app: QuartTrio) -> None:
    app.add_url_rule("/tokenize", view_func=tokenize, methods=["POST"])
    app.add_url_rule("/detokenize", view_func=detokenize, methods=["POST"])


def _any(_: Any) -> bool:
    return True


async def tokenize() -> Response:
    principal = await authorize()
    state = app_state()
    tok = state.tokenizer
    body = check_fields(await read_json(), {"model": _any, "prompt": _any, "messages": _any,
                                             "add_generation_prompt": _any})
    if "model" in body:
        await check_model(body, principal)  # an adapter shares the base model's tokenizer
    try:
        if isinstance(body.get("prompt"), str) and "messages" not in body:
            ids = tok.encode(body["prompt"])
        elif "messages" in body and "prompt" not in body:
            req = parse_chat({"model": state.config.model_name, "messages": body["messages"]}, tok, None)
            ids = req.prompt_ids
        else:
            raise bad_request("give exactly one of 'prompt' (a string) or 'messages'")
    except (InvalidText, ChatTemplateError) as e:
        raise bad_request(str(e)) from None
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": state.pool.max_model_len})


async def detokenize() -> Response:
    principal = await authorize()
    tok = app_state().tokenizer
    body = check_fields(await read_json(), {"model": _any, "tokens": _any})
    if "model" in body:
        await check_model(body, principal)  # an adapter shares the base model's tokenizer
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < tok.vocab_size for t in ids):
        raise bad_request(f"'tokens' must be an array of token ids in [0, {tok.vocab_size})", param="tokens")
    return json_response({"prompt": tok.decode(ids)})
