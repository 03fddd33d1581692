"""The OpenAI API's request and response shapes: pydantic request models, response bodies, error bodies.

Requests are validated strictly, as the OpenAI API does: an unknown field is refused (``Unrecognized request
argument supplied: ...``), so is a value of the wrong type (``"max_tokens": "10"``), and so is an option this server
does not implement set away from its default (``n=2``, ``logprobs``, penalties), each with a 400 that names it.
Extra fields that tune speculation per request use transformers' and OVMS's names (:data:`.backend.SPECULATIVE_FIELDS`).
"""

import time
import uuid
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from .backend import Finished, FinishReason, GenerationParams, SpeculativeUsage

#: OpenAI's default ``max_tokens`` of the (legacy) completions endpoint; chat completions default to the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    """An error the server answers with an OpenAI-format body (``{"error": {message, type, param, code}}``).

    Args:
        status: the HTTP status.
        message: what is wrong and how to fix it.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ``rate_limit_error``,
            ``server_error``).
        param: the request field at fault, or ``None``.
        code: OpenAI's code (``model_not_found``, ``invalid_api_key``, ``context_length_exceeded``, ...), or ``None``.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    """The body of every error answer, under ``error`` (OpenAI's format)."""

    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _integral(value):
    """An integral JSON number (``16.0``) as the integer it is, as JSON schema's ``integer`` allows; any other value
    as it is, for strict validation (``"16"`` and ``16.5`` stay refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**constraints):
    """An integer field's type: JSON schema's ``integer`` (``16`` or ``16.0``), strictly (no strings, no fractions),
    with pydantic's ``constraints`` (``ge``, ``le``: inside the type, so that the schema states them)."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _documents(**constraints):
    """``json_schema_extra`` that adds JSON-schema ``constraints`` to a field's every typed branch, so that
    /openapi.json says what the server accepts, while the server's own check (not pydantic) refuses the rest with
    a 400 that names the option and what to do (``n=2 is not supported by this server; leave it out``)."""
    by_type = {"integer": ("minimum", "maximum"), "number": ("minimum", "maximum"),
               "string": ("minLength", "maxLength"),
               "array": ("maxItems",), "object": ("maxProperties",), "boolean": ("enum",)}

    def add(schema: dict) -> None:
        for key in ("anyOf", "oneOf"):
            for branch in schema.get(key, ()):
                add(branch)
        if "items" in schema:
            add(schema["items"])
        kind = schema.get("type")
        for name, value in constraints.items():
            if kind in by_type and name in by_type[kind]:
                schema[name] = value

    return add


def _only_null(schema: dict) -> None:
    """``json_schema_extra``: the field may be left out or null only (an option this server does not implement)."""
    schema.pop("anyOf", None)
    schema["type"] = "null"


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """Fields common to completions and chat completions."""

    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[Int(ge=1)] = None
    min_tokens: Int(ge=0) = 0  # vLLM's: new tokens before EOS may end the output (stop strings still do)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[Int(ge=-2**63, le=2**63 - 1)] = None  # a 64-bit integer, as torch's generators take
    stop: Optional[Union[str, List[str]]] = Field(None, json_schema_extra=_documents(minLength=1))
    # options this server does not implement: the schema allows their defaults only, the server refuses the rest
    n: Int(ge=1) = Field(1, json_schema_extra=_documents(maximum=1))
    frequency_penalty: float = Field(0.0, json_schema_extra=_documents(minimum=0, maximum=0))
    presence_penalty: float = Field(0.0, json_schema_extra=_documents(minimum=0, maximum=0))
    logit_bias: Optional[Dict[str, float]] = Field(None, json_schema_extra=_documents(maxProperties=0))
    user: Optional[str] = None
    # speculation per request (transformers' and OVMS's names)
    num_assistant_tokens: Optional[Int(ge=1)] = None
    prompt_lookup_num_tokens: Optional[Int(ge=1)] = None
    assistant_confidence_threshold: Optional[float] = Field(None, ge=0, lt=1)
    speculative: Optional[bool] = None
    # structured output (OpenAI's field; vLLM's grammars as types "grammar" and "regex": xpuspec.grammar)
    response_format: Optional[Dict[str, Any]] = None

    def stop_strings(self) -> List[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stop):
            raise APIError(400, "stop strings must not be empty.", param="stop")
        return stop

    def refuse_unimplemented(self, logprobs) -> None:
        """Raises :class:`APIError` (400) for an option set away from its default that this server does not
        implement."""
        unimplemented = {
            "n": self.n != 1, "frequency_penalty": self.frequency_penalty != 0,
            "presence_penalty": self.presence_penalty != 0, "logit_bias": bool(self.logit_bias),
            "logprobs": logprobs not in (None, False, 0),
        }
        for name, given in unimplemented.items():
            if given:
                raise APIError(400, f"{name}={getattr(self, name)!r} is not supported by this server; leave it out "
                                    "(one choice per request, no penalties, no logprobs).", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true.", param="stream_options")

    def params(self, max_tokens: int) -> GenerationParams:
        """The decoding settings, with ``max_tokens`` resolved by the endpoint. OpenAI's defaults: temperature 1,
        top_p 1."""
        if self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={self.min_tokens} is more than max_tokens={max_tokens} (the request's "
                                "limit, or what the context leaves); lower min_tokens.", param="min_tokens")
        return GenerationParams(
            max_new_tokens=max_tokens, min_new_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
            num_assistant_tokens=self.num_assistant_tokens, prompt_lookup_num_tokens=self.prompt_lookup_num_tokens,
            assistant_confidence_threshold=self.assistant_confidence_threshold, speculative=self.speculative,
            response_format=self.checked_response_format())

    def checked_response_format(self) -> Optional[dict]:
        """``response_format`` with its shape checked (the schema compiles in the backend's check), ``None`` for
        none or ``{"type": "text"}``; raises :class:`APIError` (400, param ``response_format``) naming the problem."""
        from ..errors import ResponseFormatError
        from ..grammar import grammar_of

        try:
            return None if grammar_of(self.response_format) is None else self.response_format
        except ResponseFormatError as exc:
            raise APIError(400, str(exc), param="response_format") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _one_prompt(schema: dict) -> None:
    """``json_schema_extra`` of ``prompt``: a list holds one prompt (a text or token ids) and is not empty; a text
    is not empty (the server refuses ``""`` whatever the tokenizer would make of it)."""
    for branch in schema.get("anyOf", ()):
        if branch.get("type") == "string":
            branch["minLength"] = 1
        if branch.get("type") == "array" and branch["items"].get("type") == "string":
            branch["items"]["minLength"] = 1
        if branch.get("type") == "array":
            branch["minItems"] = 1
            if branch["items"].get("type") != "integer":
                branch["maxItems"] = 1
            else:
                branch["items"]["minimum"] = 0


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    prompt: Union[str, List[str], List[Int()], List[List[Int()]]] = Field(json_schema_extra=_one_prompt)
    logprobs: Optional[Int()] = Field(None, json_schema_extra=_documents(minimum=0, maximum=0))
    echo: bool = Field(False, json_schema_extra=_documents(enum=[False]))
    suffix: Optional[str] = Field(None, json_schema_extra=_only_null)
    best_of: Optional[Int(ge=1)] = Field(None, json_schema_extra=_documents(maximum=1))

    def check(self) -> None:
        if self.prompt == "" or self.prompt == [""]:
            raise APIError(400, "The prompt is empty; give some text (or token ids).", param="prompt")
        self.refuse_unimplemented(self.logprobs)
        for name, given in (("echo", self.echo), ("suffix", self.suffix is not None),
                            ("best_of", self.best_of not in (None, 1))):
            if given:
                raise APIError(400, f"{name} is not supported by this server; leave it out.", param=name)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, List[TextPart]]
    name: Optional[str] = None

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Int(ge=1)] = None
    logprobs: Optional[bool] = Field(None, json_schema_extra=_documents(enum=[False]))
    top_logprobs: Optional[Int()] = Field(None, json_schema_extra=_documents(minimum=0, maximum=0))
    tools: Optional[list] = Field(None, json_schema_extra=_documents(maxItems=0))
    tool_choice: Optional[Union[str, dict]] = Field(None, json_schema_extra=_documents(maxLength=0, maxProperties=0))

    def check(self) -> None:
        self.refuse_unimplemented(self.logprobs)
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; give one of them.",
                           param="max_completion_tokens")
        for name in ("top_logprobs", "tools", "tool_choice"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by this server; leave it out.", param=name)


def new_id(prefix: str) -> str:
    """An OpenAI-style object id (``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(finished: Finished, stopped_by_string: bool) -> str:
    """OpenAI's ``finish_reason``: ``"stop"`` at EOS or a stop string, ``"length"`` at the token limit."""
    if stopped_by_string or finished.reason is FinishReason.EOS:
        return "stop"
    return "length"


def speculative_decoding(usage: SpeculativeUsage) -> dict:
    """vLLM's spec-decode figures of one request, with the acceptance rate, mean acceptance length and histogram."""
    return {
        "num_drafts": usage.num_drafts,
        "num_draft_tokens": usage.num_draft_tokens,
        "num_accepted_draft_tokens": usage.num_accepted_tokens,
        "draft_acceptance_rate": usage.draft_acceptance_rate,
        "mean_acceptance_length": usage.mean_acceptance_length,
        "num_accepted_tokens_per_pos": list(usage.accepted_per_position),
        "acceptance_histogram": list(usage.acceptance_histogram),
    }


def usage_body(finished: Finished) -> dict:
    """OpenAI's ``usage``, with ``speculative_decoding`` (``None`` for plain decoding, and for a request ended early
    by a stop string, whose ``generate`` statistics end with the call), and ``prompt_tokens_details.cached_tokens``:
    the prompt tokens found in the prefix cache (``prompt_tokens_details`` is ``None`` where they are unknown)."""
    details = None if finished.cached_tokens is None else {"cached_tokens": finished.cached_tokens}
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens, "prompt_tokens_details": details,
            "speculative_decoding": None if finished.speculative is None else speculative_decoding(finished.speculative)}


class ResponseShape:
    """Builds one request's response bodies and stream chunks, completions or chat.

    Args:
        chat: chat completions (``chat.completion``) or completions (``text_completion``).
        model: the model name the request gave.
    """

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def response(self, text: str, reason: str, finished: Finished) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._envelope("chat.completion" if self.chat else "text_completion", [choice]),
                "usage": usage_body(finished)}

    def chunk(self, text: Optional[str], reason: Optional[str] = None, first: bool = False) -> dict:
        """A stream chunk with ``text`` (chat: the first also carries the role) or, with ``reason``, the last one."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, finished: Finished) -> dict:
        """The chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
        return {**self._envelope("chat.completion.chunk" if self.chat else "text_completion", []),
                "usage": usage_body(finished)}
