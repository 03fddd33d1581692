"""The OpenAI-compatible HTTP API over a serving backend: FastAPI routes, SSE streaming, auth, errors.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template),
``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics`` (Prometheus). Every error is an
OpenAI-format body (:class:`.protocol.APIError`): 400 for a malformed or invalid request, 401 for a missing or wrong
API key, 404 for an unknown model or path, 429 with ``Retry-After`` when the queue is full, 500 with a request id and
no traceback. Streams are server-sent events ending in ``data: [DONE]``; an error after a stream began comes as one
``data: {"error": ...}`` event before it. A client that disconnects cancels its request.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import List, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import XpuspecError
from .admission import DEFAULT_MAX_QUEUE, Admission, QueueFull
from .metrics import ServerMetrics
from .protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, APIError, ChatCompletionRequest, CompletionRequest,
                       GenerationRequest, ResponseShape)
from .session import Done, Failed, RequestRun, Text

log = logging.getLogger("xpuspec.serve")

#: Status nginx logs for a client that closed its request before the answer (nobody receives it).
CLIENT_CLOSED_REQUEST = 499


def create_app(backend, tokenizer, model_name: str, api_key: Optional[str] = None,
               max_queue: int = DEFAULT_MAX_QUEUE) -> FastAPI:
    """The ASGI app serving ``backend`` (:class:`.backend.SerialBackend`) under the name ``model_name``.

    Args:
        tokenizer: the model's transformers tokenizer (prompts, chat template, detokenizing).
        api_key: with it, every request needs ``Authorization: Bearer <api_key>``.
        max_queue: requests that may wait for a running place; past that, 429.
    """
    admission = Admission(backend.max_running, max_queue)
    metrics = ServerMetrics(model_name, running=lambda: admission.running, waiting=lambda: admission.waiting,
                            kv_blocks=backend.kv_blocks_in_use)
    executor = ThreadPoolExecutor(max_workers=backend.max_running, thread_name_prefix="xpuspec-generate")

    @asynccontextmanager
    async def lifespan(app):
        yield
        executor.shutdown(wait=True)

    app = FastAPI(title="xpuspec", lifespan=lifespan)
    _error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    created = int(time.time())

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "xpuspec"}

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "engine": backend.engine, "scheduling": backend.note,
                "speculative": backend.speculation, "running": admission.running, "waiting": admission.waiting,
                "max_running": admission.max_running, "max_queue": admission.max_waiting}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check()
        check_model(body.model)
        return await generate(request, body, completion_prompt(body.prompt), chat=False,
                              max_tokens=body.max_tokens, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check()
        check_model(body.model)
        return await generate(request, body, chat_prompt(body), chat=True,
                              max_tokens=body.max_completion_tokens or body.max_tokens, default_max_tokens=None)

    def completion_prompt(prompt) -> List[int]:
        if isinstance(prompt, str):
            return tokenizer(prompt).input_ids
        if len(prompt) == 0:
            raise APIError(400, "prompt is empty.", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            ids = list(prompt)
        elif len(prompt) > 1:
            raise APIError(400, f"prompt holds {len(prompt)} prompts; this server takes one prompt per request.",
                           param="prompt")
        else:
            return completion_prompt(prompt[0])
        bad = [i for i in ids if not 0 <= i < backend.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must lie in 0..{backend.vocab_size - 1}; got {bad[:5]}.",
                           param="prompt")
        return ids

    def chat_prompt(body: ChatCompletionRequest) -> List[int]:
        messages = [m.as_template_message() for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template that refuses the roles
            raise APIError(400, f"The model's chat template refused these messages: {exc}", param="messages")
        return tokenizer(text, add_special_tokens=False).input_ids

    def resolve_max_tokens(prompt_len: int, max_tokens: Optional[int], default: Optional[int]) -> int:
        context = backend.context_length
        if prompt_len == 0:
            raise APIError(400, "The prompt is empty; give some text.", param="prompt")
        if context is not None and prompt_len >= context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, your prompt has "
                                f"{prompt_len} tokens, which leaves no room to generate; shorten it.",
                           param="messages", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = default if default is not None or context is None else context - prompt_len
            return max_tokens if context is None else min(max_tokens, context - prompt_len)
        if context is not None and prompt_len + max_tokens > context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                                f"completion). Reduce max_tokens to at most {context - prompt_len}.",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    async def generate(request: Request, body: GenerationRequest, prompt_ids: List[int], chat: bool,
                       max_tokens: Optional[int], default_max_tokens: Optional[int]):
        arrival = time.perf_counter()
        params = body.params(resolve_max_tokens(len(prompt_ids), max_tokens, default_max_tokens))
        try:
            backend.check(params)
        except XpuspecError as exc:
            raise APIError(400, str(exc)) from None
        stop = body.stop_strings()
        try:
            ticket = admission.reserve()
        except QueueFull as exc:
            raise APIError(429, f"The server is busy: {admission.running} requests run and {admission.waiting} wait. "
                                f"Retry after {exc.retry_after} s.", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(exc.retry_after)}) from None
        run = RequestRun(backend, executor, admission, ticket, metrics, tokenizer, prompt_ids, params, stop, arrival)
        shape = ResponseShape(chat, body.model)
        if body.stream:
            return RunResponse(run, sse(run, shape, body.include_usage), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Request-Id": shape.id})
        return await respond(request, run, shape)

    return app


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


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        message, param = _validation_message(errors[0]) if errors else ("invalid request", None)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problems)"
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        message = f"Unknown path {request.url.path}." if exc.status_code == 404 else str(exc.detail)
        return _error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def server_error(request, exc: Exception):
        return _error_response(_as_api_error(exc, uuid.uuid4().hex))
