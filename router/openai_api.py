"""The OpenAI API surface of the gateway: request validation, errors and response formats.

* :func:`parse_request` turns a request body into a :class:`ParsedRequest` or raises
  :class:`APIError` (OpenAI's error format, ``{"error": {"message", "type", "param", "code"}}``)
  for malformed JSON, missing fields, wrong types and out-of-range values. Fields the gateway
  does not know are ignored (not forwarded to the engines either).
* :class:`Formatter` writes what the client receives: SSE chunks (``data: {json}\\n\\n``) and
  whole responses in OpenAI's shapes (``text_completion``, ``chat.completion``,
  ``chat.completion.chunk``), under the gateway's own id. Chunks are built from string templates
  with only the text JSON-encoded per chunk.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from dse.tokens import chat_prompt

COMPLETIONS = "completions"
CHAT = "chat"
PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions

_dumps = json.JSONEncoder(separators=(",", ":")).encode


class APIError(Exception):
    """An error the client sees, in OpenAI's format."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, kind: str = "bad_request"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.kind = kind          # the label of neuscale_errors_total

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=_dumps(self.body()).encode(),
                            content_type="application/json", headers=self.headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    param="model", code="model_not_found", kind="model_not_found")


def unauthorized(provided: bool) -> APIError:
    msg = ("Incorrect API key provided." if provided else
           "You didn't provide an API key. You need to provide your API key in an "
           "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
    return APIError(401, msg, code="invalid_api_key", kind="auth")


def context_length_exceeded(limit: int, prompt_tokens: int, max_tokens: int | None,
                            param: str) -> APIError:
    if max_tokens is None:
        msg = (f"This model's maximum context length is {limit} tokens. However, your "
               f"{'messages' if param == 'messages' else 'prompt'} resulted in {prompt_tokens} "
               f"tokens. Please reduce the length of the {param}.")
    else:
        msg = (f"This model's maximum context length is {limit} tokens. However, you requested "
               f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, "
               f"{max_tokens} in the completion). Please reduce the length of the {param} or "
               f"completion.")
    return APIError(400, msg, param=param, code="context_length_exceeded",
                    kind="context_length")


def no_vpod(retry_after_s: int, detail: str) -> APIError:
    return APIError(503, f"No serving capacity is available right now ({detail}); "
                         f"retry after {retry_after_s} s.",
                    type="server_error", code="no_vpod_available",
                    headers={"Retry-After": str(retry_after_s)}, kind="no_vpod")


def upstream_error(detail: str) -> APIError:
    return APIError(502, f"The request could not be completed: {detail}", type="server_error",
                    code="upstream_error", kind="upstream")


def internal_error() -> APIError:
    return APIError(500, "The server had an error while processing your request.",
                    type="server_error", code="internal_error", kind="internal")


# ---- request validation -----------------------------------------------------------------------

@dataclass
class ParsedRequest:
    """A validated request. ``upstream`` holds the fields forwarded to engines (the gateway adds
    ``max_tokens``, ``stream``, ``stream_options`` and ``kv_transfer_params`` per call)."""

    kind: str                  # COMPLETIONS | CHAT
    model: str
    prompt: str                # the text whose tokens are counted (chat: the rendered messages)
    stream: bool
    include_usage: bool        # stream_options.include_usage
    continuous_usage: bool     # stream_options.continuous_usage_stats (vLLM extension)
    max_tokens: int | None     # as the client gave it (None: the default)
    min_tokens: int
    ignore_eos: bool
    upstream: dict[str, Any]

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == CHAT else "prompt"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object", type(None): "null"}


def _type_error(param: str, expected: str, got: Any) -> APIError:
    return bad(f"Invalid type for '{param}': expected {expected}, but got "
               f"{_TYPE_NAMES.get(type(got), type(got).__name__)} instead.", param, "invalid_type")


def _opt_int(d: dict, key: str, lo: int | None = None) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise _type_error(key, "an integer", v)
    if lo is not None and v < lo:
        raise bad(f"Invalid '{key}': integer below minimum value. Expected a value >= {lo}, "
                  f"but got {v} instead.", key, "integer_below_min_value")
    return v


def _opt_num(d: dict, key: str, lo: float, hi: float) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if not _is_num(v):
        raise _type_error(key, "a number", v)
    if not lo <= v <= hi:
        raise bad(f"Invalid '{key}': expected a value between {lo:g} and {hi:g}, but got {v} "
                  f"instead.", key, "invalid_value")
    return v


def _opt_bool(d: dict, key: str) -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _type_error(key, "a boolean", v)
    return v


def _messages(v: Any) -> list[dict[str, Any]]:
    if v is None:
        raise bad("Missing required parameter: 'messages'.", "messages",
                  "missing_required_parameter")
    if not isinstance(v, list):
        raise _type_error("messages", "an array", v)
    if not v:
        raise bad("Invalid 'messages': empty array. Expected an array with minimum length 1.",
                  "messages", "empty_array")
    out = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(p, "an object", m)
        role = m.get("role")
        if role is None:
            raise bad(f"Missing required parameter: '{p}.role'.", f"{p}.role",
                      "missing_required_parameter")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"Invalid value for '{p}.role': expected one of {sorted(ROLES)}.",
                      f"{p}.role", "invalid_value")
        c = m.get("content")
        if c is None:
            if role != "assistant":
                raise bad(f"Missing required parameter: '{p}.content'.", f"{p}.content",
                          "missing_required_parameter")
        elif isinstance(c, list):
            for j, part in enumerate(c):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad(f"Invalid '{p}.content[{j}]': expected an object with a 'type'.",
                              f"{p}.content[{j}]", "invalid_value")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise _type_error(f"{p}.content[{j}].text", "a string", part.get("text"))
        elif not isinstance(c, str):
            raise _type_error(f"{p}.content", "a string or an array", c)
        out.append({k: m[k] for k in ("role", "content", "name") if k in m})
    return out


def parse_request(kind: str, raw: bytes) -> ParsedRequest:
    """Validate a /v1/completions (``kind`` COMPLETIONS) or /v1/chat/completions (CHAT) body."""
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad("We could not parse the JSON body of your request. (HINT: This likely means "
                  "you aren't using your HTTP library correctly. The OpenAI API expects a JSON "
                  "payload.)") from None
    if not isinstance(d, dict):
        raise bad("The request body must be a JSON object.")
    model = d.get("model")
    if model is None:
        raise bad("You must provide a model parameter.", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)

    up: dict[str, Any] = {"model": model}
    if kind == CHAT:
        msgs = _messages(d.get("messages"))
        up["messages"] = msgs
        prompt = chat_prompt(msgs)
        mt = _opt_int(d, "max_completion_tokens", 1)
        mt2 = _opt_int(d, "max_tokens", 1)
        max_tokens = mt if mt is not None else mt2
        lp = d.get("logprobs")
        if lp not in (None, False):
            raise bad("logprobs are not supported by this server.", "logprobs", "unsupported_value")
    else:
        p = d.get("prompt")
        if p is None:
            raise bad("Missing required parameter: 'prompt'.", "prompt",
                      "missing_required_parameter")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list):
            raise bad("Only one prompt per request is supported (a string).", "prompt",
                      "unsupported_value")
        if not isinstance(p, str):
            raise _type_error("prompt", "a string", p)
        if not p:
            raise bad("Invalid 'prompt': the prompt must not be empty.", "prompt", "invalid_value")
        up["prompt"] = prompt = p
        max_tokens = _opt_int(d, "max_tokens", 1)
        if d.get("echo") not in (None, False):
            raise bad("echo is not supported by this server.", "echo", "unsupported_value")
        if d.get("logprobs") is not None:
            raise bad("logprobs are not supported by this server.", "logprobs", "unsupported_value")
        best_of = _opt_int(d, "best_of", 1)
        if best_of is not None and best_of != 1:
            raise bad("best_of must be 1 on this server.", "best_of", "unsupported_value")

    n = _opt_int(d, "n", 1)
    if n is not None and n != 1:
        raise bad("n must be 1 on this server (one choice per request).", "n", "unsupported_value")
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0),
                        ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        v = _opt_num(d, key, lo, hi)
        if v is not None and key in ("temperature", "top_p"):
            up[key] = v
    stream = bool(_opt_bool(d, "stream"))
    so = d.get("stream_options")
    include_usage = continuous = False
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        if not stream:
            raise bad("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                      "stream_options", "invalid_value")
        include_usage = bool(_opt_bool(so, "include_usage"))
        continuous = bool(_opt_bool(so, "continuous_usage_stats"))
    stop = d.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop] if stop else []
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stop = [s for s in stop if s]
        else:
            raise _type_error("stop", "a string or an array of strings", stop)
        if stop:
            up["stop"] = stop
    seed = _opt_int(d, "seed")
    if seed is not None:
        up["seed"] = seed
    ignore_eos = bool(_opt_bool(d, "ignore_eos"))
    if ignore_eos:
        up["ignore_eos"] = True
    min_tokens = _opt_int(d, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad(f"min_tokens ({min_tokens}) must be less than or equal to max_tokens "
                  f"({max_tokens}).", "min_tokens", "invalid_value")
    return ParsedRequest(kind, model, prompt, stream, include_usage, continuous, max_tokens,
                         min_tokens, ignore_eos, up)


# ---- what the client receives -----------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex


def usage_json(prompt_tokens: int, completion_tokens: int) -> str:
    return (f'{{"prompt_tokens":{prompt_tokens},"completion_tokens":{completion_tokens},'
            f'"total_tokens":{prompt_tokens + completion_tokens}}}')


class Formatter:
    """The client-facing chunks and responses of one request (its id, created time, model)."""

    __slots__ = ("kind", "id", "created", "model", "_head")

    def __init__(self, kind: str, model: str, id: str | None = None,
                 created: int | None = None):
        self.kind = kind
        self.id = id or new_id(kind)
        self.created = int(time.time()) if created is None else created
        self.model = model
        obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
        self._head = (f'data: {{"id":"{self.id}","object":"{obj}","created":{self.created},'
                      f'"model":{_dumps(model)},"choices":[')

    def role_chunk(self, usage: str | None = None) -> bytes:
        """Chat streams open with the assistant's role (as OpenAI and vLLM do)."""
        return self._chunk('{"role":"assistant","content":""}', "null", usage)

    def text_chunk(self, text: str, finish_reason: str | None, usage: str | None = None) -> bytes:
        fr = "null" if finish_reason is None else f'"{finish_reason}"'
        if self.kind == CHAT:
            delta = f'{{"content":{_dumps(text)}}}' if text or finish_reason is None else "{}"
            return self._chunk(delta, fr, usage)
        tail = f',"usage":{usage}}}\n\n' if usage else "}\n\n"
        return (f'{self._head}{{"index":0,"text":{_dumps(text)},"logprobs":null,'
                f'"finish_reason":{fr}}}]{tail}').encode()

    def _chunk(self, delta: str, fr: str, usage: str | None) -> bytes:
        tail = f',"usage":{usage}}}\n\n' if usage else "}\n\n"
        return (f'{self._head}{{"index":0,"delta":{delta},"logprobs":null,'
                f'"finish_reason":{fr}}}]{tail}').encode()

    def usage_chunk(self, usage: str) -> bytes:
        """The chunk with ``choices: []`` and the usage (``stream_options.include_usage``)."""
        return f'{self._head}],"usage":{usage}}}\n\n'.encode()

    @staticmethod
    def error_event(err: APIError) -> bytes:
        """A mid-stream error (headers already sent), then the stream ends."""
        return b"data: " + _dumps(err.body()).encode() + b"\n\n"

    DONE = b"data: [DONE]\n\n"

    def response(self, text: str, finish_reason: str | None, prompt_tokens: int,
                 completion_tokens: int) -> bytes:
        """A whole (non-streaming) response body."""
        usage = usage_json(prompt_tokens, completion_tokens)
        fr = "null" if finish_reason is None else f'"{finish_reason}"'
        if self.kind == CHAT:
            choice = (f'{{"index":0,"message":{{"role":"assistant","content":{_dumps(text)}}},'
                      f'"logprobs":null,"finish_reason":{fr}}}')
            obj = "chat.completion"
        else:
            choice = (f'{{"index":0,"text":{_dumps(text)},"logprobs":null,'
                      f'"finish_reason":{fr}}}')
            obj = "text_completion"
        return (f'{{"id":"{self.id}","object":"{obj}","created":{self.created},'
                f'"model":{_dumps(self.model)},"choices":[{choice}],"usage":{usage}}}').encode()


def models_response(model: str, max_context: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "neuscale", "max_model_len": max_context}]}
