"""The OpenAI wire format at the gateway: request checks, errors, chat <-> completions.

Every request becomes one upstream ``/v1/completions`` call whose prompt is
token ids: a chat request is rendered with the tokenizer's chat template
here, and the engine's completion answer (or each SSE chunk of it) is
turned back into the chat shape. Errors are OpenAI-shaped::

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": 400}}

Pure: no HTTP server, no sockets. The app (`kvmesh.gateway.app`) calls it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    KVMeshError,
    MessageTooLarge,
    NoWorkers,
    PermissionDenied,
    TransportError,
    Unauthenticated,
    UnknownModel,
)
from kvmesh.gateway.tokenizer import PromptTokenizer

_HTTP_OF_ERROR: tuple[tuple[type[KVMeshError], int, str], ...] = (
    (UnknownModel, 404, "not_found_error"),
    (MessageTooLarge, 413, "invalid_request_error"),
    (InvalidInput, 400, "invalid_request_error"),
    (ConfigError, 400, "invalid_request_error"),
    (Unauthenticated, 401, "authentication_error"),
    (PermissionDenied, 403, "permission_error"),
    (NoWorkers, 503, "service_unavailable_error"),
    (DeadlineExceeded, 504, "timeout_error"),
    (TransportError, 502, "upstream_error"),
)
"""First match wins, so subclasses come before their bases."""

CHAT_ONLY_REFUSED: dict[str, str] = {
    "tools": "tool calling is not supported through the gateway",
    "functions": "function calling is not supported through the gateway",
    "logprobs": "chat logprobs are not supported through the gateway; use /v1/completions",
    "top_logprobs": "chat logprobs are not supported through the gateway; use /v1/completions",
    "continue_final_message": "continue_final_message is not supported through the gateway",
    "echo": "chat echo is not supported through the gateway",
}
"""Chat fields with no faithful completions equivalent: refused, never silently dropped."""

_CHAT_DROPPED = frozenset(
    {"messages", "add_generation_prompt", "chat_template_kwargs", "max_completion_tokens"}
)


def http_status(exc: KVMeshError) -> tuple[int, str]:
    """The HTTP status and OpenAI error type an error travels as (500 when unknown)."""
    for cls, status, kind in _HTTP_OF_ERROR:
        if isinstance(exc, cls):
            return status, kind
    return 500, "internal_error"


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# ---------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A checked request, ready to route: the upstream completions body lacks only `prompt`.

    `chat`: the answer must be turned back into the chat shape.
    """

    chat: bool
    token_ids: list[int]
    upstream: dict[str, Any]
    stream: bool
    cache_salt: str | None
    model: str | None

    def body_for_engine(self, model: str) -> dict[str, Any]:
        """The upstream body: token ids as the prompt, the salt and the served model filled in."""
        body = dict(self.upstream)
        body["prompt"] = self.token_ids
        body["model"] = model
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        else:
            body.pop("cache_salt", None)
        return body


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; `InvalidInput` saying what is wrong otherwise."""
    if not raw.strip():
        raise InvalidInput("the request body is empty: send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_common(body: Mapping[str, Any]) -> None:
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise InvalidInput(f"'stream' must be true or false, got {stream!r:.40}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidInput(f"'model' must be a string, got {type(model).__name__}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not _is_int(value) or value < 0):
            raise InvalidInput(f"'{name}' must be a non-negative integer, got {value!r:.40}")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidInput("'cache_salt' must be a non-empty string when given")


def _token_ids(value: list[Any], vocab_size: int) -> list[int]:
    if not value:
        raise InvalidInput("'prompt' is an empty list of token ids")
    for t in value:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise InvalidInput(
                f"'prompt' token ids must be integers in [0, {vocab_size}), got {t!r:.40}"
            )
    return list(value)


def prompt_tokens(prompt: object, tokenizer: PromptTokenizer) -> list[int]:
    """A completions `prompt` (text, token ids, or a one-element list of either) as token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidInput("'prompt' is empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, str | list) for p in prompt):
            raise InvalidInput(
                f"'prompt' holds {len(prompt)} prompts: the gateway routes one prompt per "
                "request; send them as separate requests"
            )
        return _token_ids(prompt, tokenizer.vocab_size)
    if prompt is None:
        raise InvalidInput("'prompt' is required")
    raise InvalidInput(
        f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}"
    )


def prepare_completion(
    body: dict[str, Any], tokenizer: PromptTokenizer, cache_salt: str | None
) -> PreparedRequest:
    _check_common(body)
    tokens = prompt_tokens(body.get("prompt"), tokenizer)
    upstream = {k: v for k, v in body.items() if k != "prompt"}
    return PreparedRequest(
        False, tokens, upstream, bool(body.get("stream")), cache_salt, body.get("model")
    )


def _message_text(content: object, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidInput(
                    f"messages[{i}]: content part of type {kind!r} is not supported through "
                    "the gateway (text parts only)"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidInput(f"messages[{i}]: a text part needs a string 'text'")
            parts.append(text)
        return "\n".join(parts)
    raise InvalidInput(
        f"messages[{i}]: 'content' must be a string or a list of parts, got "
        f"{type(content).__name__}"
    )


def chat_messages(messages: object) -> list[dict[str, str]]:
    """`messages` checked and flattened to ``{role, content}`` text, as the template takes them."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("'messages' must be a non-empty list of {role, content} objects")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidInput(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidInput(f"messages[{i}] needs a 'role' string")
        out.append({"role": role, "content": _message_text(m.get("content"), i)})
    return out


def prepare_chat(
    body: dict[str, Any], tokenizer: PromptTokenizer, cache_salt: str | None
) -> PreparedRequest:
    _check_common(body)
    for name, why in CHAT_ONLY_REFUSED.items():
        value = body.get(name)
        if value not in (None, False, [], "none"):
            raise InvalidInput(why)
    messages = chat_messages(body.get("messages"))
    add_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_prompt, bool):
        raise InvalidInput("'add_generation_prompt' must be true or false")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidInput("'chat_template_kwargs' must be an object")
    tokens = tokenizer.render_chat(
        messages, add_generation_prompt=add_prompt, template_kwargs=kwargs
    )
    upstream = {
        k: v for k, v in body.items() if k not in _CHAT_DROPPED and k not in CHAT_ONLY_REFUSED
    }
    if body.get("max_completion_tokens") is not None:
        upstream["max_tokens"] = body["max_completion_tokens"]
    return PreparedRequest(
        True, tokens, upstream, bool(body.get("stream")), cache_salt, body.get("model")
    )


# ---------------------------------------------------------------------------- answers


def _chat_id(completion_id: object) -> str:
    text = str(completion_id or "")
    return "chatcmpl-" + text.removeprefix("cmpl-")


def chat_from_completion(answer: Mapping[str, Any]) -> dict[str, Any]:
    """An engine's ``text_completion`` answer in the ``chat.completion`` shape."""
    choices = []
    for c in answer.get("choices") or []:
        choice = {
            "index": c.get("index", 0),
            "message": {"role": "assistant", "content": c.get("text", "")},
            "logprobs": None,
            "finish_reason": c.get("finish_reason"),
        }
        if "stop_reason" in c:
            choice["stop_reason"] = c["stop_reason"]
        choices.append(choice)
    out = {
        "id": _chat_id(answer.get("id")),
        "object": "chat.completion",
        "created": answer.get("created"),
        "model": answer.get("model"),
        "choices": choices,
    }
    if "usage" in answer:
        out["usage"] = answer["usage"]
    return out


class ChatStreamTranslator:
    """Turns an engine's completion SSE lines into chat-completion SSE events, one by one.

    The first chunk of each choice carries ``role: assistant``, as OpenAI's
    do; error events and ``[DONE]`` pass unchanged.
    """

    __slots__ = ("_started",)

    def __init__(self) -> None:
        self._started: set[int] = set()

    def event(self, line: str) -> bytes | None:
        """The SSE event for one upstream line, or None for a line that carries none."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            return b"data: [DONE]\n\n"
        try:
            chunk = json.loads(data)
        except ValueError:
            return None
        if not isinstance(chunk, dict) or "error" in chunk:
            return b"data: " + data.encode() + b"\n\n"
        return sse(self.chunk(chunk))

    def chunk(self, chunk: Mapping[str, Any]) -> dict[str, Any]:
        choices = []
        for c in chunk.get("choices") or []:
            index = c.get("index", 0)
            delta: dict[str, Any] = {}
            if index not in self._started:
                self._started.add(index)
                delta["role"] = "assistant"
            delta["content"] = c.get("text", "")
            choices.append(
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": c.get("finish_reason"),
                }
            )
        out = {
            "id": _chat_id(chunk.get("id")),
            "object": "chat.completion.chunk",
            "created": chunk.get("created"),
            "model": chunk.get("model"),
            "choices": choices,
        }
        if chunk.get("usage") is not None:
            out["usage"] = chunk["usage"]
        return out


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def served_models(answer: Mapping[str, Any]) -> list[str]:
    """Model ids in an engine's ``/v1/models`` answer."""
    data = answer.get("data")
    if not isinstance(data, Sequence):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
