"""Parse and validate OpenAI request bodies into one engine-ready ``GenerationRequest``.

Every accepted field is listed here with its type; anything else is a 400 naming the field ("nothing is
silently ignored"). Ranges are checked by ``ipc.sampling.SamplingParams``, the wire message itself, so the gateway
and the worker can never disagree on what is valid. A JSON ``null`` means "not given", as in OpenAI's API.

``n`` (both routes) and ``best_of`` (completions only, as OpenAI) ask for several sequences of one prompt; each
becomes a worker request of its own (``gateway.pipeline.choices``). Both are at most ``MAX_N``; ``best_of`` is at
least ``n`` and cannot stream when it is larger (the best are known only once all have ended). A completions
``prompt`` may be a list of prompts (strings or token-id arrays, as OpenAI's and vLLM's): every prompt gets its
``n`` choices, indexed ``prompt * n + choice``, at most ``MAX_SEQUENCES`` sequences in all.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.base.errors import APIError, bad_request
from gateway.pipeline.chat_messages import parse_messages, template_input
from gateway.pipeline.response_format import STRUCTURED_FIELDS, structured_spec
from gateway.pipeline.tokenizer import ChatTemplateError, GatewayTokenizer, InvalidText
from gateway.pipeline.tools import ToolConfig, grammar_spec, parse_tools
from ipc.sampling import MAX_LOGIT_BIAS, SamplingParams
from tenancy.tiers import SERVICE_TIERS

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_TOP_LOGPROBS = 20
MAX_PRIORITY = 2**31 - 1  # vLLM's priority is any int; the wire carries it in 32 bits comfortably
MAX_N = 16  # the most sequences (n, best_of) one request may ask for: each holds its own KV blocks on a worker
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CACHE_KEY_CHARS = 1024  # prompt_cache_key: a name, hashed into a routing key
MAX_SEQUENCES = 64  # prompts x best_of of one completions request (LangChain batches 20 prompts by default)

Kind = Literal["chat", "completion"]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a completions request that lists several."""

    ids: list[int]
    echo: str | None = None  # with echo: its text, sent before its choices' completions


@dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    prompt_ids: list[int]  # the prompt (the first one, when a completions request lists several: ``batch``)
    sampling: SamplingParams  # validated here; what the worker gets
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool  # whether to return logprobs at all
    top_logprobs: int  # alternatives per token when logprobs
    n: int = 1  # choices returned
    best_of: int = 1  # sequences generated (>= n); the n with the highest cumulative logprob are returned
    tools: ToolConfig | None = None  # chat with tools: the answer is split into content and tool_calls
    prompt_logprobs: int | None = None  # vLLM's field: the prompt's logprobs with this many alternatives
    echo: str | None = None  # completions with echo: the prompt's text, sent before the completion
    priority: int = 0  # vLLM's: lower runs sooner (workers' priority scheduling policy; fcfs refuses others)
    batch: tuple[Prompt, ...] = ()  # a completions request that lists prompts: all of them, in order
    service_tier: str | None = None  # OpenAI's (tenancy.tiers.SERVICE_TIERS); None: not asked
    prompt_cache_key: str | None = None  # OpenAI's routing hint: requests sharing it go where the last one went

    def prompts(self) -> tuple[Prompt, ...]:
        """Every prompt, in choice order (one, but for a completions request that lists several)."""
        return self.batch or (Prompt(self.prompt_ids, self.echo),)

    @property
    def prompt_tokens(self) -> int:
        """What the request's prompts count (usage, quota): every prompt's tokens."""
        return sum(len(p.ids) for p in self.prompts())

    @property
    def sequences(self) -> int:
        """Worker requests it makes: ``best_of`` per prompt."""
        return self.best_of * len(self.prompts())


# ---- field types ---------------------------------------------------------------------------------

def _is_bool(v: Any) -> bool:
    return type(v) is bool


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _is_str(v: Any) -> bool:
    return type(v) is str


def _is_any(v: Any) -> bool:  # structured fields checked by their own parser below
    return True


_TYPE_NAMES: dict[Callable[[Any], bool], str] = {
    _is_bool: "a boolean", _is_int: "an integer", _is_number: "a number", _is_str: "a string", _is_any: "a value"}

_SAMPLING_FIELDS: dict[str, Callable[[Any], bool]] = {
    "temperature": _is_number, "top_p": _is_number, "top_k": _is_int, "min_p": _is_number, "seed": _is_int,
    "presence_penalty": _is_number, "frequency_penalty": _is_number, "repetition_penalty": _is_number,
    "min_tokens": _is_int, "ignore_eos": _is_bool, "stop_token_ids": _is_any,
}
_COMMON_FIELDS: dict[str, Callable[[Any], bool]] = {
    "model": _is_str, "stream": _is_bool, "stream_options": _is_any, "max_tokens": _is_int, "stop": _is_any,
    "n": _is_int, "user": _is_str, "prompt_logprobs": _is_int, "priority": _is_int, "logit_bias": _is_any,
    "service_tier": _is_str, "prompt_cache_key": _is_str,
    **_SAMPLING_FIELDS,
    **STRUCTURED_FIELDS,
}
CHAT_FIELDS = {**_COMMON_FIELDS, "messages": _is_any, "max_completion_tokens": _is_int, "logprobs": _is_bool,
               "top_logprobs": _is_int, "tools": _is_any, "tool_choice": _is_any, "parallel_tool_calls": _is_bool,
               "store": _is_bool}
COMPLETION_FIELDS = {**_COMMON_FIELDS, "prompt": _is_any, "logprobs": _is_int, "echo": _is_bool,
                     "best_of": _is_int}


def check_fields(body: Any, allowed: dict[str, Callable[[Any], bool]]) -> dict[str, Any]:
    """The body as a dict without nulls, every key known and of the right JSON type."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in body.items():
        check = allowed.get(key)
        if check is None:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key,
                              code="unrecognized_argument")
        if value is None:
            continue
        if not check(value):
            raise bad_request(f"'{key}' must be {_TYPE_NAMES[check]}, got {_json_type(value)}", param=key)
        out[key] = value
    return out


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), "null")


# ---- structured fields --------------------------------------------------------------------------

def _stop(fields: dict[str, Any]) -> tuple[str, ...]:
    stop = fields.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("'stop' must be a string or an array of strings", param="stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' allows at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in items):
        raise bad_request(f"'stop' strings must have 1..{MAX_STOP_CHARS} characters", param="stop")
    return tuple(items)


def _stream_options(fields: dict[str, Any], stream: bool) -> bool:
    opts = fields.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    for key, value in opts.items():
        if key != "include_usage":
            raise bad_request(f"Unrecognized request argument supplied: stream_options.{key}",
                              param=f"stream_options.{key}", code="unrecognized_argument")
        if value is not None and type(value) is not bool:
            raise bad_request("'stream_options.include_usage' must be a boolean", param="stream_options")
    return bool(opts.get("include_usage"))


def _token_ids(value: Any, vocab_size: int, param: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise bad_request(f"'{param}' must be an array of integers", param=param)
    if any(not 0 <= t < vocab_size for t in value):
        raise bad_request(f"'{param}' holds token ids outside [0, {vocab_size})", param=param)
    return value


def _completion_prompts(value: Any, tok: GatewayTokenizer) -> list[tuple[list[int], str | None]]:
    """``prompt``: a string, token ids, or a list of either (a batch); each prompt's ids and its text, if it was
    text (what ``echo`` returns for it)."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > MAX_SEQUENCES:
            raise bad_request(f"'prompt' lists {len(value)} prompts; at most {MAX_SEQUENCES} are allowed",
                              param="prompt")
        return [_one_prompt(v, tok, f"prompt[{i}]" if len(value) > 1 else "prompt") for i, v in enumerate(value)]
    if isinstance(value, list) and not value:
        raise bad_request("'prompt' must not be empty", param="prompt")
    return [_one_prompt(value, tok, "prompt")]


def _one_prompt(value: Any, tok: GatewayTokenizer, where: str) -> tuple[list[int], str | None]:
    text = value if isinstance(value, str) else None
    if text is not None:
        try:
            ids = tok.encode(text)
        except InvalidText as e:
            raise bad_request(f"{where}: {e}" if where != "prompt" else str(e), param="prompt") from e
    elif isinstance(value, list) and all(type(t) is int for t in value):
        ids = _token_ids(value, tok.vocab_size, "prompt")
    else:
        raise bad_request("'prompt' must be a string, an array of token ids, or an array of either",
                          param="prompt")
    if not ids:
        raise bad_request(f"'{where}' must not be empty", param="prompt")
    return ids, text


# ---- assembly ----------------------------------------------------------------------------------

_PARAM_RE = re.compile(r"^([a-z_]+) ")


def _structured(fields: dict[str, Any], tools: ToolConfig | None) -> str | None:
    spec = structured_spec(fields)
    if tools is None or not tools.calls_allowed:
        return spec
    return grammar_spec(tools, None if spec is None else json.loads(spec))


def _sampling(fields: dict[str, Any], max_tokens: int, top_logprobs: int | None, vocab: int,
              tools: ToolConfig | None = None,
              prompt_logprobs: int | None = None) -> SamplingParams:
    kw = {k: fields[k] for k in _SAMPLING_FIELDS if k in fields}
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = _token_ids(kw["stop_token_ids"], vocab, "stop_token_ids")
    if "logit_bias" in fields:
        kw["logit_bias"] = _logit_bias(fields["logit_bias"], vocab)
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=top_logprobs,
                              structured=_structured(fields, tools), prompt_logprobs=prompt_logprobs, **kw)
    except ValueError as e:  # the wire type's own range check; its messages start with the field name
        m = _PARAM_RE.match(str(e))
        raise bad_request(str(e), param=m.group(1) if m else None) from e


def _logit_bias(value: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object from token ids (decimal strings, JSON keys) to biases in [-100, 100]."""
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' allows at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab:
            raise bad_request(f"'logit_bias' key {key!r} is not a token id in [0, {vocab})", param="logit_bias")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias' value for token {key} must be a number in [-100, 100]",
                              param="logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def _max_tokens(fields: dict[str, Any], key: str, prompt_len: int, max_model_len: int | None,
                default: int | None, prompt_param: str, default_cap: int | None = None) -> int:
    room = None if max_model_len is None else max_model_len - prompt_len
    if room is not None and room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt has {prompt_len} tokens, leaving no room for a completion.",
                       code="context_length_exceeded", param=prompt_param)
    requested = fields.get(key, default)
    if requested is None:
        requested = room if room is not None else 16
        if default_cap is not None:
            # The tenant's per-request bound: a client that asked for nothing gets the most it may have,
            # not a 400 for a number it never sent.
            requested = min(requested, default_cap)
    if requested < 1:
        raise bad_request(f"'{key}' must be at least 1, got {requested}", param=key)
    if room is not None and requested > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                       "for the completion). Please reduce the prompt or the completion length.",
                       code="context_length_exceeded", param=key)
    return int(requested)


def _count(fields: dict[str, Any], key: str, default: int) -> int:
    value = int(fields.get(key, default))
    if value < 1:
        raise bad_request(f"'{key}' must be at least 1, got {value}", param=key)
    if value > MAX_N:
        raise bad_request(f"'{key}' must be at most {MAX_N}, got {value}", param=key)
    return value


def _best_of(fields: dict[str, Any], n: int, stream: bool) -> int:
    best_of = _count(fields, "best_of", n)  # vLLM's default: as many as are returned
    if best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be greater than or equal to 'n' ({n})", param="best_of")
    if stream and best_of > n:
        raise bad_request("'best_of' greater than 'n' cannot be streamed: the best are known only at the end",
                          param="best_of")
    return best_of


def _common_checks(fields: dict[str, Any]) -> tuple[bool, bool, tuple[str, ...], int]:
    stream = bool(fields.get("stream", False))
    return stream, _stream_options(fields, stream), _stop(fields), _count(fields, "n", 1)


def _service_tier(fields: dict[str, Any]) -> str | None:
    value = fields.get("service_tier")
    if value is not None and value not in SERVICE_TIERS:
        raise bad_request(f"'service_tier' must be one of {', '.join(map(repr, SERVICE_TIERS))}, got {value!r}",
                          param="service_tier")
    return value


def _prompt_cache_key(fields: dict[str, Any]) -> str | None:
    key = fields.get("prompt_cache_key")
    if key is not None and not 0 < len(key) <= MAX_CACHE_KEY_CHARS:
        raise bad_request(f"'prompt_cache_key' must have 1..{MAX_CACHE_KEY_CHARS} characters", param="prompt_cache_key")
    return key


def _priority(fields: dict[str, Any]) -> int:
    p = int(fields.get("priority", 0))
    if not -MAX_PRIORITY <= p <= MAX_PRIORITY:
        raise bad_request(f"'priority' must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]", param="priority")
    return p


def _prompt_logprobs(fields: dict[str, Any]) -> int | None:
    k = fields.get("prompt_logprobs")
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'prompt_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", param="prompt_logprobs")
    return k


def _echo(fields: dict[str, Any], ids: list[int], text: str | None, tok: GatewayTokenizer) -> str | None:
    if not fields.get("echo", False):
        return None
    return text if text is not None else tok.decode(ids)  # token ids: their text


def _not_stored(fields: dict[str, Any]) -> None:
    """OpenAI's ``store`` on chat completions (false by default): ``false`` asks for what happens anyway. A chat
    completion is never kept here; the Responses API is what stores (and lists, and continues from)."""
    if fields.get("store") is True:
        raise bad_request("'store': true is not supported on chat completions: they are not kept here. The "
                          "Responses API (POST /v1/responses) stores what it answers", param="store",
                          code="unsupported_value")


def parse_chat(body: Any, tok: GatewayTokenizer, max_model_len: int | None,
               default_max_tokens_cap: int | None = None) -> GenerationRequest:
    fields = check_fields(body, CHAT_FIELDS)
    _not_stored(fields)
    stream, include_usage, stop, n = _common_checks(fields)
    if "messages" not in fields:
        raise bad_request("'messages' is required", param="messages")
    messages = parse_messages(fields["messages"])
    tools = parse_tools(fields, tok.tool_format)
    logprobs = bool(fields.get("logprobs", False))
    top = fields.get("top_logprobs")
    if top is not None and not logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    if "max_tokens" in fields and "max_completion_tokens" in fields:
        raise bad_request("give 'max_tokens' or 'max_completion_tokens', not both", param="max_tokens")
    try:
        prompt_ids = tok.apply_chat_template(*template_input(messages, tools, tok.tool_format, tok.tool_role))
    except (ChatTemplateError, InvalidText) as e:
        raise bad_request(str(e), param="messages") from e
    key = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    max_tokens = _max_tokens(fields, key, len(prompt_ids), max_model_len, None, "messages", default_max_tokens_cap)
    n_top = (top or 0) if logprobs else None
    prompt_lps = _prompt_logprobs(fields)
    sampling = _sampling(fields, max_tokens, n_top, tok.vocab_size, tools, prompt_lps)
    return GenerationRequest("chat", prompt_ids, sampling, max_tokens, stop, stream, include_usage, logprobs,
                             n_top or 0, n, n, tools, prompt_lps, priority=_priority(fields),
                             service_tier=_service_tier(fields), prompt_cache_key=_prompt_cache_key(fields))


def parse_completion(body: Any, tok: GatewayTokenizer, max_model_len: int | None,
                     default_max_tokens_cap: int | None = None) -> GenerationRequest:
    fields = check_fields(body, COMPLETION_FIELDS)
    stream, include_usage, stop, n = _common_checks(fields)
    best_of = _best_of(fields, n, stream)
    if "prompt" not in fields:
        raise bad_request("'prompt' is required", param="prompt")
    given = _completion_prompts(fields["prompt"], tok)
    if len(given) * best_of > MAX_SEQUENCES:
        raise bad_request(f"{len(given)} prompts x {best_of} sequences each is {len(given) * best_of}; at most "
                          f"{MAX_SEQUENCES} sequences a request", param="prompt")
    prompts = tuple(Prompt(ids, _echo(fields, ids, text, tok)) for ids, text in given)
    n_top = fields.get("logprobs")
    if n_top is not None and not 0 <= n_top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
    max_tokens = _max_tokens(fields, "max_tokens", max(len(p.ids) for p in prompts), max_model_len,
                             COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt", default_max_tokens_cap)
    # Ranking needs each sampled token's logprob: ask the worker for it (0 alternatives) even when the client
    # did not ask for logprobs; OutputAssembler returns them only to a client that did.
    worker_top = 0 if n_top is None and best_of > n else n_top
    prompt_lps = _prompt_logprobs(fields)
    echo = prompts[0].echo
    # echo with logprobs returns the prompt's tokens with theirs, as OpenAI's legacy completions did
    wanted = [k for k in (prompt_lps, n_top if echo is not None else None) if k is not None]
    worker_prompt_lps = max(wanted) if wanted else None
    sampling = _sampling(fields, max_tokens, worker_top, tok.vocab_size, prompt_logprobs=worker_prompt_lps)
    return GenerationRequest("completion", prompts[0].ids, sampling, max_tokens, stop, stream, include_usage,
                             n_top is not None, n_top or 0, n, best_of, None, prompt_lps, echo, _priority(fields),
                             prompts if len(prompts) > 1 else (), _service_tier(fields), _prompt_cache_key(fields))
