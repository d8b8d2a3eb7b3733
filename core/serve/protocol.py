"""OpenAI request bodies → what the backend needs, validated before any work.

:func:`parse_completion` (``POST /v1/completions``), :func:`parse_chat`
(``POST /v1/chat/completions``) and :func:`parse_embeddings` (``POST /v1/embeddings``) take the
decoded JSON body (a dict) and return a :class:`GenerationJob` / :class:`EmbeddingJob`, or raise
:class:`APIError` with the HTTP status and OpenAI's error body (``{"error": {"message", "type",
"param", "code"}}``) naming the offending parameter:

* a parameter OpenAI defines that this server does not implement (``logit_bias``, ``tools``,
  ``response_format``, ``best_of``, ``echo``, ``suffix``, …) or a field OpenAI does not define →
  400 naming it; nothing is silently ignored. ``user`` is accepted and ignored: it is only an
  end-user identifier for the caller's own abuse monitoring, it changes no output.
* a wrong type or a value out of OpenAI's range → 400 naming the parameter.
* a ``model`` other than the served one → 404.
* ``max_tokens`` ≤ 0, or the prompt plus ``max_tokens`` beyond what one sequence may hold (the
  smaller of the model's context and the backend's cache) → 400. Without ``max_tokens`` a
  sequence may generate up to that capacity (as vLLM does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ShardwiseError
from .types import GenRequest, SamplingParams

#: most choices (``n`` × prompts) one request may ask for
MAX_CHOICES = 64
#: most ``stop`` strings (OpenAI's limit)
MAX_STOP = 4
#: most ``logprobs`` / ``top_logprobs`` (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
#: most inputs of one embeddings request (OpenAI's limit)
MAX_EMBED_INPUTS = 2048

#: parameters OpenAI defines for each endpoint that this server does not implement
UNSUPPORTED = {
    "completions": ("best_of", "echo", "logit_bias", "suffix"),
    "chat": ("logit_bias", "tools", "tool_choice", "response_format", "functions",
             "function_call", "parallel_tool_calls", "audio", "modalities", "prediction",
             "reasoning_effort", "service_tier", "store", "metadata", "web_search_options",
             "verbosity", "prompt_cache_key", "prompt_cache_retention", "safety_identifier"),
    "embeddings": ("dimensions",),
}
_ROLES = ("system", "developer", "user", "assistant")


class APIError(ShardwiseError):
    """An HTTP error in OpenAI's format: ``status`` and the body :meth:`body` gives;
    ``headers`` go on the response (``Retry-After`` for 429)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str) -> APIError:
    """A 400 about ``param``."""
    return APIError(400, message, param=param, code="invalid_value")


@dataclass
class GenerationJob:
    """A validated completions or chat request.

    ``prompts``: token ids of each prompt (chat: one, the templated conversation); each gets
    ``n`` choices, choice index ``p * n + i`` (OpenAI's order for a batch of prompts)."""

    kind: str  # "completion" | "chat"
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    #: chat: logprobs asked for (``top_logprobs`` alone is params.logprobs)
    logprobs: bool = False

    def requests(self, request_id: str) -> list[tuple[int, GenRequest]]:
        """(choice index, the sequence to submit) for every choice."""
        out = []
        for p, ids in enumerate(self.prompts):
            for i in range(self.n):
                choice = p * self.n + i
                out.append((choice, GenRequest(f"{request_id}-{choice}", list(ids),
                                               self.params, index=i)))
        return out


@dataclass
class EmbeddingJob:
    """A validated embeddings request: token ids of each input, the encoding of the vectors."""

    inputs: list[list[int]]
    encoding_format: str = "float"


# ----- field checks ------------------------------------------------------------------------------

def _number(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"'{name}' must be a number, got {value!r}")
    if value > hi or value < lo or (lo_open and value == lo):
        low = f"> {lo}" if lo_open else f">= {lo}"
        raise bad(name, f"'{name}' must be {low} and <= {hi}, got {value!r}")
    return float(value)


def _integer(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"'{name}' must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad(name, f"'{name}' must be {span}, got {value}")
    return value


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false, got {value!r}")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"'stop' must be a non-empty string or a list of them, got {value!r}")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"'stop' takes at most {MAX_STOP} strings, got {len(stops)}")
    return tuple(stops)


def _stream_options(value: Any) -> bool:
    """→ include_usage."""
    if not isinstance(value, dict):
        raise bad("stream_options", f"'stream_options' must be an object, got {value!r}")
    for key in value:
        if key != "include_usage":
            raise bad(f"stream_options.{key}",
                      f"'stream_options.{key}' is not supported (only include_usage is)")
    return _boolean("stream_options.include_usage", value.get("include_usage", False))


def _check_fields(body: dict, endpoint: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """Refuse unsupported and unknown fields; → the body without null values (null = default)."""
    for name in body:
        if name in UNSUPPORTED[endpoint]:
            raise APIError(400, f"parameter '{name}' is not supported by this server; remove it",
                           param=name, code="unsupported_parameter")
        if name not in allowed:
            raise APIError(400, f"unknown parameter '{name}'; this endpoint takes: "
                           f"{', '.join(allowed)}", param=name, code="unknown_parameter")
    return {k: v for k, v in body.items() if v is not None}


def _check_model(body: dict, model_name: str) -> None:
    if "model" not in body:
        raise bad("model", "'model' is required")
    if body["model"] != model_name:
        raise APIError(404, f"the model '{body['model']}' does not exist; this server serves "
                       f"'{model_name}' (GET /v1/models)", param="model",
                       code="model_not_found")


# ----- prompts -----------------------------------------------------------------------------------

def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _texts_or_ids(name: str, value: Any, encode: Callable[[str], list[int]],
                  vocab_size: int) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists → token ids
    of each prompt."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif _is_ids(value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise bad(name, f"'{name}' must be a non-empty string, a list of strings, a list of "
                  f"token ids or a list of such lists, got {value!r:.80}")
    out = []
    for i, item in enumerate(items):
        where = name if len(items) == 1 else f"{name}[{i}]"
        if isinstance(item, str):
            ids = encode(item)
        elif _is_ids(item):
            ids = list(item)
            if any(t < 0 or t >= vocab_size for t in ids):
                raise bad(where, f"'{where}' has token ids outside the vocabulary "
                          f"(0..{vocab_size - 1})")
        else:
            raise bad(where, f"'{where}' must be a non-empty string or list of token ids")
        if not ids:
            raise bad(where, f"'{where}' is empty (no tokens)")
        out.append(ids)
    return out


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content[{j}]", f"'messages[{i}].content[{j}]' must "
                          f"be a text part ({{\"type\": \"text\", \"text\": ...}}); other "
                          f"content types are not supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", f"'messages[{i}].content' must be a string or a list "
              f"of text parts")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", f"'messages[{i}]' must be an object")
        for key in message:
            if key not in ("role", "content", "name"):
                raise bad(f"messages[{i}].{key}", f"'messages[{i}].{key}' is not supported "
                          f"(tools and function calls are not)")
        if message.get("role") not in _ROLES:
            raise bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of "
                      f"{', '.join(_ROLES)}, got {message.get('role')!r}")
        turn = {"role": message["role"], "content": _message_text(i, message.get("content"))}
        if "name" in message:  # handed to the chat template, which may show it
            if not isinstance(message["name"], str):
                raise bad(f"messages[{i}].name", f"'messages[{i}].name' must be a string")
            turn["name"] = message["name"]
        out.append(turn)
    return out


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation through the tokenizer's chat template, with the assistant's turn
    opened (``add_generation_prompt``) → token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions "
                       "with a prompt instead", param="messages", code="no_chat_template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ----- sampling ----------------------------------------------------------------------------------

def _max_tokens(body: dict, prompts: list[list[int]], capacity: int) -> int:
    """``max_tokens`` checked against what one sequence holds; absent: all that fits."""
    longest = max(len(p) for p in prompts)
    if longest >= capacity:
        raise APIError(400, f"the prompt is {longest} tokens; this server holds at most "
                       f"{capacity} tokens per sequence (prompt + completion), so shorten it",
                       param="messages" if "messages" in body else "prompt",
                       code="context_length_exceeded")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if name not in body:
        return capacity - longest
    value = _integer(name, body[name])
    if value <= 0:
        raise bad(name, f"'{name}' must be at least 1, got {value}")
    if longest + value > capacity:
        raise APIError(400, f"the prompt ({longest} tokens) plus '{name}' ({value}) is "
                       f"{longest + value} tokens; this server holds at most {capacity} per "
                       f"sequence: lower '{name}' to {capacity - longest} or less",
                       param=name, code="context_length_exceeded")
    return value


def _sampling(body: dict, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number("temperature", body.get("temperature", 1.0), 0.0, 2.0),
        top_p=_number("top_p", body.get("top_p", 1.0), 0.0, 1.0, lo_open=True),
        seed=_integer("seed", body["seed"]) if "seed" in body else None,
        stop=_stop(body["stop"]) if "stop" in body else (),
        logprobs=logprobs,
        presence_penalty=_number("presence_penalty", body.get("presence_penalty", 0.0),
                                 -2.0, 2.0),
        frequency_penalty=_number("frequency_penalty", body.get("frequency_penalty", 0.0),
                                  -2.0, 2.0))


def _streaming(body: dict) -> tuple[bool, bool]:
    """→ (stream, include_usage)."""
    stream = _boolean("stream", body.get("stream", False))
    if "stream_options" in body and not stream:
        raise bad("stream_options", "'stream_options' is only allowed with 'stream': true")
    include = _stream_options(body["stream_options"]) if "stream_options" in body else False
    return stream, include


def _job(kind: str, body: dict, prompts: list[list[int]], capacity: int,
         logprobs: int | None, chat_logprobs: bool = False) -> GenerationJob:
    n = _integer("n", body.get("n", 1), 1, MAX_CHOICES)
    if n * len(prompts) > MAX_CHOICES:
        raise bad("n", f"{len(prompts)} prompts × n={n} is more than the {MAX_CHOICES} "
                  f"choices one request may ask for")
    params = _sampling(body, _max_tokens(body, prompts, capacity), logprobs)
    stream, include_usage = _streaming(body)
    return GenerationJob(kind, prompts, params, n=n, stream=stream,
                         include_usage=include_usage, logprobs=chat_logprobs)


_COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
           "logprobs", "stop", "presence_penalty", "frequency_penalty", "seed", "user")


def parse_completion(body: dict, *, tokenizer: Any, model_name: str,
                     capacity: int) -> GenerationJob:
    """A ``/v1/completions`` body → the job (``prompt``: a string, a list of strings, token
    ids or a list of token-id lists; ``logprobs``: 0..20 most likely tokens per position)."""
    body = _check_fields(body, "completions", _COMMON + ("prompt",))
    _check_model(body, model_name)
    if "prompt" not in body:
        raise bad("prompt", "'prompt' is required")
    prompts = _texts_or_ids("prompt", body["prompt"],
                            lambda text: list(tokenizer(text)["input_ids"]), len(tokenizer))
    logprobs = (_integer("logprobs", body["logprobs"], 0, MAX_TOP_LOGPROBS)
                if "logprobs" in body else None)
    return _job("completion", body, prompts, capacity, logprobs)


def parse_chat(body: dict, *, tokenizer: Any, model_name: str, capacity: int) -> GenerationJob:
    """A ``/v1/chat/completions`` body → the job (the conversation through the chat template;
    ``logprobs`` true with ``top_logprobs`` 0..20)."""
    body = _check_fields(body, "chat", _COMMON + ("messages", "max_completion_tokens",
                                                  "top_logprobs"))
    _check_model(body, model_name)
    if "messages" not in body:
        raise bad("messages", "'messages' is required")
    prompt = chat_prompt(tokenizer, _messages(body["messages"]))
    wanted = _boolean("logprobs", body.get("logprobs", False))
    top = body.get("top_logprobs")
    if top is not None:
        top = _integer("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
        if not wanted:
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return _job("chat", body, [prompt], capacity, (top or 0) if wanted else None,
                chat_logprobs=wanted)


def parse_embeddings(body: dict, *, tokenizer: Any, model_name: str,
                     capacity: int) -> EmbeddingJob:
    """A ``/v1/embeddings`` body → the job (``input``: a string, strings, token ids or lists of
    them, each at most ``capacity`` tokens; ``encoding_format``: float or base64)."""
    body = _check_fields(body, "embeddings", ("model", "input", "encoding_format", "user"))
    _check_model(body, model_name)
    if "input" not in body:
        raise bad("input", "'input' is required")
    inputs = _texts_or_ids("input", body["input"],
                           lambda text: list(tokenizer(text)["input_ids"]), len(tokenizer))
    if len(inputs) > MAX_EMBED_INPUTS:
        raise bad("input", f"at most {MAX_EMBED_INPUTS} inputs per request, got {len(inputs)}")
    for i, ids in enumerate(inputs):
        if len(ids) > capacity:
            raise APIError(400, f"input {i} is {len(ids)} tokens; the model takes at most "
                           f"{capacity}", param="input", code="context_length_exceeded")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"'encoding_format' must be 'float' or 'base64', "
                  f"got {fmt!r}")
    return EmbeddingJob(inputs, fmt)
