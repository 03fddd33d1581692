"""The OpenAI-compatible HTTP API over a serving backend: FastAPI routes, SSE streaming, auth, errors.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template),
``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics`` (Prometheus). Every error is an
OpenAI-format body (:class:`.protocol.APIError`): 400 for a malformed or invalid request (validation errors
included: never FastAPI's 422), 401 for a missing or wrong API key, 404 for an unknown model or path, 413 for a body
past ``max_body_bytes``, 429 with ``Retry-After`` when the queue is full, 503 while the server shuts down, 500 with a
request id and no traceback; ``/openapi.json`` documents exactly these. Streams are server-sent events ending in
``data: [DONE]``; an error after a stream began comes as one ``data: {"error": ...}`` event before it. A client that
disconnects cancels its request.

The handlers are module-level functions; what they share is one :class:`ServerState` on ``app.state.server``. The
event loop never does work that grows with a request's size: a body past the limit is refused from its
``Content-Length`` (or as soon as it passes the limit), a prompt past the character or token bound gets a 400 before
it is tokenized, and tokenizing and chat templating run on a small thread pool.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import List, Optional, Union

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import chat_token_ids
from ..errors import XpuspecError
from .admission import DEFAULT_MAX_BODY_MIB, DEFAULT_MAX_QUEUE, Admission, QueueFull
from .drain import Drain, shutting_down
from .metrics import ServerMetrics
from .protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, APIError, ChatCompletionRequest, CompletionRequest,
                       ErrorResponse, GenerationRequest, ResponseShape)
from .session import Done, Failed, RequestRun, Text

log = logging.getLogger("xpuspec.serve")

#: Status nginx logs for a client that closed its request before the answer (nobody receives it).
CLIENT_CLOSED_REQUEST = 499
#: Threads that tokenize prompts and apply chat templates, off the event loop.
PREP_THREADS = 2


@dataclass(frozen=True)
class Limits:
    """Bounds checked before any work on a request.

    Attributes:
        max_body_bytes: a longer request body gets a 413 (read no further than the limit).
        max_prompt_chars: a longer prompt (completions: the text; chat: the messages' text together) gets a 400
            before it is tokenized; ``None``: no bound.
    """

    max_body_bytes: int
    max_prompt_chars: Optional[int]


def longest_token_chars(tokenizer) -> int:
    """Characters of the tokenizer's longest token (at least 1): no token covers more of a text."""
    tokens = list(tokenizer.get_vocab())
    return max([len(tokenizer.convert_tokens_to_string([t])) for t in tokens] + [1])


def default_max_prompt_chars(tokenizer, context_length: Optional[int]) -> Optional[int]:
    """The most characters a prompt that fits ``context_length`` tokens can have: the context times the longest
    token's characters (a longer text needs more tokens than the context holds); ``None`` when the context is
    unknown."""
    return None if context_length is None else context_length * longest_token_chars(tokenizer)


class ServerState:
    """What the handlers share: the backend, the tokenizer, the queue, the metrics, the worker threads, the drain.

    Args:
        backend: a :class:`.backend.SerialBackend`.
        tokenizer: the model's transformers tokenizer (prompts, chat template, detokenizing).
        model_name: the name clients give.
        max_queue: requests that may wait for a running place; past that, 429.
        limits: the body and prompt bounds.
    """

    def __init__(self, backend, tokenizer, model_name: str, max_queue: int, limits: Limits):
        self.backend, self.tokenizer, self.model_name, self.limits = backend, tokenizer, model_name, limits
        self.admission = admission = Admission(backend.max_running, max_queue)
        self.metrics = ServerMetrics(model_name, running=lambda: admission.running,
                                     waiting=lambda: admission.waiting, kv_blocks=backend.kv_blocks_in_use,
                                     prefix_cache=backend.prefix_cache_counts)
        self.executor = ThreadPoolExecutor(max_workers=backend.max_running, thread_name_prefix="xpuspec-generate")
        self.prep = ThreadPoolExecutor(max_workers=PREP_THREADS, thread_name_prefix="xpuspec-tokenize")
        self.drain = Drain()
        self.created = int(time.time())

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "xpuspec"}

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    async def close(self) -> None:
        """Stop the drain's timer, and wait (off the event loop) for the worker threads."""
        self.drain.close()
        self.prep.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.executor.shutdown, wait=True)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


# -- routes -----------------------------------------------------------------------------------------------------

#: The error statuses every generation route may answer, as /openapi.json documents them.
ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": description} for status, description in (
    (400, "A malformed or invalid request (OpenAI's format; FastAPI's 422 is never sent)."),
    (401, "A missing or wrong API key (with --api-key)."),
    (404, "An unknown model."),
    (413, "A request body past the server's --max-body-mib."),
    (429, "The queue is full; retry after the Retry-After header's seconds."),
    (500, "The server failed on this request; the message holds its request id."),
    (503, "The server is shutting down."))}
#: A generation's 200: JSON, or server-sent events with ``stream: true``.
GENERATION_OK = {200: {"description": "The completion (JSON), or with stream=true server-sent events ending in "
                                      "`data: [DONE]`.",
                       "content": {"application/json": {}, "text/event-stream": {}}}}
#: The errors of the other routes.
READ_ERRORS = {status: ERROR_RESPONSES[status] for status in (401, 500)}

router = APIRouter()


@router.get("/health", responses=READ_ERRORS)
async def health(request: Request):
    s = server_state(request)
    a = s.admission
    return {"status": "draining" if s.drain.draining else "ok", "model": s.model_name, "engine": s.backend.engine,
            "scheduling": s.backend.note, "speculative": s.backend.speculation,
            "prefix_caching": s.backend.prefix_caching, "running": a.running,
            "waiting": a.waiting, "max_running": a.max_running, "max_queue": a.max_waiting}


@router.get("/metrics", responses=READ_ERRORS, response_class=Response)
async def prometheus(request: Request):
    metrics = server_state(request).metrics
    return Response(metrics.exposition(), media_type=metrics.content_type)


@router.get("/v1/models", responses=READ_ERRORS)
async def models(request: Request):
    return {"object": "list", "data": [server_state(request).model_card()]}


@router.get("/v1/models/{name:path}", responses={**READ_ERRORS, 404: ERROR_RESPONSES[404]})
async def model(name: str, request: Request):
    s = server_state(request)
    s.check_model(name)
    return s.model_card()


@router.post("/v1/completions", responses={**GENERATION_OK, **ERROR_RESPONSES})
async def completions(body: CompletionRequest, request: Request):
    s = server_state(request)
    body.check()
    s.check_model(body.model)
    prompt = completion_prompt(s, body.prompt)
    ids = await asyncio.get_running_loop().run_in_executor(s.prep, prompt_ids, s, prompt)
    return await generate(s, request, body, ids, chat=False, max_tokens=body.max_tokens,
                          default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)


@router.post("/v1/chat/completions", responses={**GENERATION_OK, **ERROR_RESPONSES})
async def chat_completions(body: ChatCompletionRequest, request: Request):
    s = server_state(request)
    body.check()
    s.check_model(body.model)
    messages = [m.as_template_message() for m in body.messages]
    check_chars(s, sum(len(m["content"]) for m in messages), "messages", "the messages' text together")
    ids = await asyncio.get_running_loop().run_in_executor(s.prep, chat_ids, s, messages)
    return await generate(s, request, body, ids, chat=True,
                          max_tokens=body.max_completion_tokens or body.max_tokens, default_max_tokens=None)


# -- prompts ----------------------------------------------------------------------------------------------------

def check_chars(s: ServerState, chars: int, param: str, what: str) -> None:
    """A 400 for a prompt past the character bound, before it is tokenized."""
    bound = s.limits.max_prompt_chars
    if bound is not None and chars > bound:
        context = s.backend.context_length
        fits = f"this model's context of {context} tokens holds at most {bound} characters" if context \
            else f"this server takes at most {bound} characters"
        raise APIError(400, f"The prompt is too long: {what} has {chars} characters, and {fits}; shorten it.",
                       param=param, code="context_length_exceeded")


def completion_prompt(s: ServerState, prompt) -> Union[str, List[int]]:
    """The one prompt of a completions request, as text or token ids, within the bounds (a 400 otherwise). Cheap:
    runs on the event loop."""
    if isinstance(prompt, str):
        check_chars(s, len(prompt), "prompt", "the prompt")
        return prompt
    if len(prompt) == 0:
        raise APIError(400, "The prompt is an empty list of token ids; give at least one token.", param="prompt")
    if not isinstance(prompt[0], int):  # validated: a list of texts or of token-id lists
        if len(prompt) > 1:
            raise APIError(400, f"prompt holds {len(prompt)} prompts; this server takes one prompt per request.",
                           param="prompt")
        return completion_prompt(s, prompt[0])
    context = s.backend.context_length  # validated: a list of token ids, bounded before they are checked
    if context is not None and len(prompt) >= context:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, your prompt has "
                            f"{len(prompt)} tokens, which leaves no room to generate; shorten it.",
                       param="prompt", code="context_length_exceeded")
    return list(prompt)


def prompt_ids(s: ServerState, prompt: Union[str, List[int]]) -> List[int]:
    """Token ids of a completions prompt (runs on the tokenizing threads). Text is tokenized as vLLM does, with the
    tokenizer's special tokens: SmolLM2's adds its BOS, so ``""`` is the BOS alone; a tokenizer that adds none
    makes ``""`` an empty prompt, refused by :func:`resolve_max_tokens`."""
    if isinstance(prompt, str):
        return s.tokenizer(prompt).input_ids
    vocab = s.backend.vocab_size
    bad = [i for i in prompt if not 0 <= i < vocab]
    if bad:
        raise APIError(400, f"prompt token ids must lie in 0..{vocab - 1}; got {bad[:5]}.", param="prompt")
    return prompt


def chat_ids(s: ServerState, messages: List[dict]) -> List[int]:
    """Token ids of the chat template applied to ``messages`` (runs on the tokenizing threads)."""
    try:
        return chat_token_ids(s.tokenizer, messages)
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template that refuses the roles
        raise APIError(400, f"The model's chat template refused these messages: {exc}", param="messages")


def resolve_max_tokens(context: Optional[int], prompt_len: int, max_tokens: Optional[int], default: Optional[int],
                       prompt_param: str) -> int:
    """The request's ``max_new_tokens``: ``max_tokens``, else ``default``, else the rest of the context.

    Raises:
        APIError: (400) an empty prompt, or one that leaves no room in the context, or ``max_tokens`` past it.
    """
    if prompt_len == 0:
        raise APIError(400, "The prompt is empty (this model's tokenizer adds no BOS token to an empty text); give "
                            "some text.", param=prompt_param)
    if context is not None and prompt_len >= context:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, your prompt has "
                            f"{prompt_len} tokens, which leaves no room to generate; shorten it.",
                       param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = default if default is not None or context is None else context - prompt_len
        return max_tokens if context is None else min(max_tokens, context - prompt_len)
    if context is not None and prompt_len + max_tokens > context:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                            f"completion). Reduce max_tokens to at most {context - prompt_len}.",
                       param="max_tokens", code="context_length_exceeded")
    return max_tokens


# -- generation -------------------------------------------------------------------------------------------------

async def generate(s: ServerState, request: Request, body: GenerationRequest, ids: List[int], chat: bool,
                   max_tokens: Optional[int], default_max_tokens: Optional[int]):
    """Queue the request and answer it: a stream of events, or the whole response."""
    arrival = time.perf_counter()
    if s.drain.draining:
        raise shutting_down("it takes no new requests")
    params = body.params(resolve_max_tokens(s.backend.context_length, len(ids), max_tokens, default_max_tokens,
                                            "messages" if chat else "prompt"))
    try:
        s.backend.check(params)
    except XpuspecError as exc:
        raise APIError(400, str(exc)) from None
    stop = body.stop_strings()
    try:
        ticket = s.admission.reserve()
    except QueueFull as exc:
        raise APIError(429, f"The server is busy: {s.admission.running} requests run and {s.admission.waiting} wait. "
                            f"Retry after {exc.retry_after} s.", type="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": str(exc.retry_after)}) from None
    run = RequestRun(s.backend, s.executor, s.admission, ticket, s.metrics, s.tokenizer, ids, params, stop, arrival,
                     on_close=s.drain.runs.discard)
    s.drain.runs.add(run)
    shape = ResponseShape(chat, body.model)
    if body.stream:
        return RunResponse(run, sse(run, shape, body.include_usage), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Request-Id": shape.id})
    return await respond(request, run, shape)


async def sse(run: RequestRun, shape: ResponseShape, include_usage: bool):
    """The request's server-sent events: chunks, the last chunk with its finish reason, the usage if asked, [DONE]."""
    def event(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    if shape.chat:
        yield event(shape.chunk("", first=True))
    async for ev in run.events():
        if isinstance(ev, Text):
            yield event(shape.chunk(ev.text))
        elif isinstance(ev, Done):
            yield event(shape.chunk(None, ev.finish_reason))
            if include_usage:
                yield event(shape.usage_chunk(ev.finished))
        elif isinstance(ev, Failed):
            yield event(_as_api_error(ev.error, shape.id).body())
    yield "data: [DONE]\n\n"


async def respond(request: Request, run: RequestRun, shape: ResponseShape) -> Response:
    """The whole response of a request that does not stream; its client leaving cancels it."""
    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        run.cancel()

    watcher = asyncio.ensure_future(watch_disconnect())
    texts = []
    try:
        async for ev in run.events():
            if isinstance(ev, Text):
                texts.append(ev.text)
            elif isinstance(ev, Done):
                return JSONResponse(shape.response("".join(texts), ev.finish_reason, ev.finished),
                                    headers={"X-Request-Id": shape.id})
            elif isinstance(ev, Failed):
                raise _as_api_error(ev.error, shape.id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        watcher.cancel()
        run.close()


class RunResponse(StreamingResponse):
    """A stream whose run is closed however the response ends (also when it never began to send)."""

    def __init__(self, run: RequestRun, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


def _as_api_error(error: BaseException, request_id: str) -> APIError:
    """A backend's exception as the client sees it: a bad setting (xpuspec's errors, ValueError) is a 400, anything
    else a 500 with the request id (the traceback goes to the server's log)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, (XpuspecError, ValueError, NotImplementedError)):
        return APIError(400, str(error))
    log.error("request %s failed", request_id, exc_info=error)
    return APIError(500, f"The server failed on this request (request id {request_id}); its log has the details.",
                    type="server_error", code="internal_error")


# -- middleware -------------------------------------------------------------------------------------------------

class BearerAuth:
    """ASGI middleware: every HTTP request needs ``Authorization: Bearer <api_key>``, else a 401."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                message = ("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'." if given is None
                           else "Incorrect API key provided.")
                error = APIError(401, message, type="authentication_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body past ``max_bytes`` gets a 413 at once, from its ``Content-Length`` or as soon
    as what arrived passes the limit, without reading (or keeping) more of it; a body within it is read whole and
    handed on."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: str) -> JSONResponse:
        return _error_response(APIError(
            413, f"The request body is {size}; this server takes at most {self.max_bytes} bytes (--max-body-mib). "
                 "Send a shorter prompt.", code="request_too_large"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(f"{int(length)} bytes")(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                chunks = None
                first = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(f"more than {self.max_bytes} bytes")(scope, receive, send)
                return
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, replay, send)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _validation_message(error: dict) -> tuple:
    """(message, param) of one pydantic error, in the OpenAI API's words where it has them."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if error.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if error.get("type") == "json_invalid":
        return ("We could not parse the JSON body of your request: "
                f"{error.get('ctx', {}).get('error', 'invalid JSON')}. Send a JSON object."), None
    return (f"{param}: {error.get('msg')}" if param else error.get("msg", "invalid request")), param


async def _api_error(request, exc: APIError):
    return _error_response(exc)


async def _invalid(request, exc: RequestValidationError):
    errors = exc.errors()
    message, param = _validation_message(errors[0]) if errors else ("invalid request", None)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return _error_response(APIError(400, message, param=param))


async def _http_error(request, exc: StarletteHTTPException):
    message = f"Unknown path {request.url.path}." if exc.status_code == 404 else str(exc.detail)
    return _error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))


async def _server_error(request, exc: Exception):
    return _error_response(_as_api_error(exc, uuid.uuid4().hex))


# -- the app ----------------------------------------------------------------------------------------------------

#: Request fields the schema lists only where the server applies them: field -> what the backend needs.
NEEDS_DRAFT_MODEL = ("assistant_confidence_threshold",)


def openapi_schema(app: FastAPI) -> dict:
    """/openapi.json as this server answers: OpenAI-format errors (400, never 422), and the request fields this
    server's model applies (``assistant_confidence_threshold`` only with a draft model; the server refuses it
    otherwise with a 400 that says so)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        server = app.state.server
        context, vocab = server.backend.context_length, server.backend.vocab_size
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            properties = components.get(name, {}).get("properties", {})
            if not server.backend.has_draft_model:
                for field in NEEDS_DRAFT_MODEL:
                    properties.pop(field, None)
            properties.get("model", {})["enum"] = [server.model_name]
            for field in ("max_tokens", "max_completion_tokens"):
                for branch in properties.get(field, {}).get("anyOf", ()):
                    if branch.get("type") == "integer" and context is not None:
                        branch["maximum"] = context - 1
        prompt = components.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
        _bound_prompt(prompt, server.limits.max_prompt_chars, vocab, context)
        app.openapi_schema = schema
    return app.openapi_schema


def _bound_prompt(prompt: dict, max_chars: Optional[int], vocab: int, context: Optional[int]) -> None:
    """The schema of a completions ``prompt`` with this server's bounds: texts of at most ``max_chars`` characters,
    token ids in the vocabulary, lists of ids shorter than the context."""
    for branch in prompt.get("anyOf", ()):
        inner = branch.get("items", {})
        texts = branch if branch.get("type") == "string" else inner if inner.get("type") == "string" else None
        if texts is not None:
            if max_chars is not None:
                texts["maxLength"] = max_chars
            continue
        ids = inner if inner.get("type") == "array" else branch  # [[ids]] or [ids]
        if ids.get("items", {}).get("type") == "integer":
            ids["items"].update(minimum=0, maximum=vocab - 1)
            ids["minItems"] = 1
            if context is not None:
                ids["maxItems"] = context - 1


@asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    await app.state.server.close()


def create_app(backend, tokenizer, model_name: str, api_key: Optional[str] = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_MIB * 2**20,
               max_prompt_chars: Optional[int] = -1) -> FastAPI:
    """The ASGI app serving ``backend`` (:class:`.backend.SerialBackend`) under the name ``model_name``.

    Args:
        tokenizer: the model's transformers tokenizer (prompts, chat template, detokenizing).
        api_key: with it, every request needs ``Authorization: Bearer <api_key>``.
        max_queue: requests that may wait for a running place; past that, 429.
        max_body_bytes: request bodies past it get a 413.
        max_prompt_chars: prompts past it get a 400 before they are tokenized (-1: the context's worth of the
            tokenizer's longest token, :func:`default_max_prompt_chars`; ``None``: no bound).
    """
    if max_prompt_chars == -1:
        max_prompt_chars = default_max_prompt_chars(tokenizer, backend.context_length)
    app = FastAPI(title="xpuspec", lifespan=_lifespan)
    app.state.server = ServerState(backend, tokenizer, model_name, max_queue, Limits(max_body_bytes, max_prompt_chars))
    app.include_router(router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.openapi = lambda: openapi_schema(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)  # outermost: a 401 before the body is read
    return app
