"""The OpenAI-compatible HTTP app: routes, authorization, request checks, answers whole or streamed.

    GET  /v1/models             the model this server serves, and MODEL:ADAPTER for each adapter it serves
    POST /v1/completions        a prompt (text or token ids) continued
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /health                200 while every block is served by some usable peer, else 503
    GET  /metrics               Prometheus text format

Every error is OpenAI's shape (client/api/errors.py). A streamed request answers its errors before the first
token as plain HTTP errors (the stream starts only once a first token or the end is known), and those after it
as an `{"error": ...}` event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.api.config import ApiConfig
from client.api.errors import ApiError, from_swarm_error, internal_error
from client.api.generation import Backend, Finish, GenerationParams
from client.api.jobs import ClientGone, Failed, Job, JobRunner, Text
from client.api.metrics import CONTENT_TYPE, ApiMetrics
from client.api.responses import DONE, Shape, sse
from client.api.schemas import ChatRequest, CompletionRequest, Sampling, parse_body
from protocol.errors import SwarmError

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
CLIENT_GONE = "499"  # the status label of requests whose client disconnected (nginx's convention)


def create_app(backend: Backend, config: ApiConfig, adapters: dict[str, Backend] | None = None) -> FastAPI:
    """An ASGI app serving `backend` as `config.model_id`, and each of `adapters` (adapter name -> a backend whose
    client computes with it, ClientConfig.adapter) as `{model_id}:{name}`; its metrics live in `app.state.metrics`
    (a registry of its own)."""
    backends = {config.model_id: backend, **{f"{config.model_id}:{name}": b for name, b in (adapters or {}).items()}}
    speculating = getattr(backend, "drafter", None) is not None  # swarmlm api --speculative
    metrics = ApiMetrics(backend.failovers, backend.speculative if speculating else None)
    runner = JobRunner(backend, metrics, config.max_concurrency, config.max_queued)
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await asyncio.to_thread(runner.shutdown)

    app = FastAPI(title="swarmlm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.metrics, app.state.runner, app.state.backend = metrics, runner, backend

    def count(request: Request, status: int | str) -> None:
        path = request.url.path
        metrics.requests.labels(path if path in _ENDPOINTS else "other", str(status)).inc()

    def answer_error(request: Request, error: ApiError) -> JSONResponse:
        count(request, error.status)
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return answer_error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        what = {
            404: f"no route {request.method} {request.url.path}; the API is under /v1 (GET /v1/models)",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, exc.detail)
        return answer_error(
            request, ApiError(exc.status_code, what, code="not_found" if exc.status_code == 404 else None)
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error answering %s %s", request.method, request.url.path)
        return answer_error(request, internal_error(exc))

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if not header:
            raise ApiError(
                401, "missing API key: send it as the header `Authorization: Bearer KEY`", code="invalid_api_key"
            )
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")

    def check_model(name: str) -> str:
        """The id of the model a request names (an alias is the base model's)."""
        if name in config.aliases:
            return config.model_id
        if name not in backends:
            raise ApiError(
                404,
                f"the model {name!r} does not exist on this server, which serves {', '.join(map(repr, backends))} "
                f"(GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return name

    # --- routes ---

    @app.get("/health")
    async def health(request: Request):
        try:
            uncovered = await asyncio.to_thread(backend.uncovered_blocks)
        except SwarmError as exc:
            count(request, 503)
            return JSONResponse({"status": "unavailable", "model": config.model_id, "message": str(exc)}, 503)
        if uncovered:
            count(request, 503)
            spans = block_ranges(uncovered)
            return JSONResponse(
                {
                    "status": "unavailable",
                    "model": config.model_id,
                    "uncovered_blocks": spans,
                    "message": f"no usable peer serves blocks {', '.join(spans)} of "
                    f"{config.model_id}; start one with `swarmlm peer MODEL --blocks "
                    f"{spans[0]}`",
                },
                503,
            )
        count(request, 200)
        return {"status": "ok", "model": config.model_id}

    @app.get("/metrics")
    async def metrics_text(request: Request):
        count(request, 200)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": started, "owned_by": "swarmlm"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        count(request, 200)
        return {"object": "list", "data": [model_card(model_id) for model_id in backends]}

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str):
        authorize(request)
        model_id = check_model(name)
        count(request, 200)
        return model_card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    # --- generation ---

    async def generate(request: Request, *, chat: bool):
        arrived = time.perf_counter()
        authorize(request)
        body = parse_body(await read_body(request, config.max_body_bytes), ChatRequest if chat else CompletionRequest)
        model_id = check_model(body.model)
        if chat:
            prompt_ids = await asyncio.to_thread(backend.encode_chat, body.chat_messages())
        else:
            prompt_ids = await asyncio.to_thread(backend.encode_prompt, body.prompt_value())
        params = GenerationParams(
            prompt_ids=tuple(prompt_ids),
            max_tokens=max_tokens(body, len(prompt_ids), chat),
            sampling=Sampling(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
            ),
            stop=body.stop_strings(),
            ignore_eos=bool(body.ignore_eos),
            stream=bool(body.stream),
        )
        gone = asyncio.Event()
        watcher = asyncio.create_task(watch_disconnect(request, gone))
        job: Job | None = None
        try:
            job = await runner.start(params, gone, arrived, backends[model_id])
            first = await job.next_event()
            if isinstance(first, Failed):
                raise generation_error(first.error)
            shape = Shape(chat=chat, model=model_id)
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                stream = stream_events(request, job, first, shape, include_usage)
                watcher_owned, watcher = watcher, None  # the stream stops it when it ends
                return EventStream(stream, on_close=lambda: (job.cancel.set(), watcher_owned.cancel()))
            return await whole_answer(request, job, first, shape)
        except ClientGone:
            count(request, CLIENT_GONE)
            return Response(status_code=499)
        except BaseException:
            if job is not None:
                job.cancel.set()
            raise
        finally:
            if watcher is not None:
                watcher.cancel()

    def max_tokens(body, prompt_tokens: int, chat: bool) -> int:
        context = backend.context_length
        where = "messages" if chat else "prompt"
        if prompt_tokens >= context:
            raise ApiError(
                400,
                f"this model's maximum context length is {context} tokens, and the {where} alone "
                f"take {prompt_tokens}; shorten {'them' if chat else 'it'}",
                param=where,
                code="context_length_exceeded",
            )
        asked = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        if asked is None:
            default = config.default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
            return min(default, context - prompt_tokens)
        if prompt_tokens + asked > context:
            param = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
            raise ApiError(
                400,
                f"this model's maximum context length is {context} tokens; the {where} has "
                f"{prompt_tokens} and {param}={asked} asks for {prompt_tokens + asked} in all; "
                f"shorten the {where} or ask for at most {context - prompt_tokens} tokens",
                param=param,
                code="context_length_exceeded",
            )
        return asked

    async def whole_answer(request: Request, job: Job, event, shape: Shape):
        pieces = []
        while True:
            if isinstance(event, Text):
                pieces.append(event.text)
            elif isinstance(event, Failed):
                raise generation_error(event.error)
            elif isinstance(event, Finish):
                if event.reason == "cancelled":
                    raise ClientGone()
                count(request, 200)
                return shape.whole("".join(pieces), event.reason, len(job.params.prompt_ids), event.completion_tokens)
            event = await job.next_event()

    async def stream_events(request: Request, job: Job, event, shape: Shape, include_usage: bool):
        status = "200"
        try:
            if shape.chat:
                yield sse(shape.chunk("", first=True))
            while True:
                if isinstance(event, Text):
                    yield sse(shape.chunk(event.text))
                elif isinstance(event, Failed):
                    error = generation_error(event.error)
                    status = str(error.status)
                    yield sse(error.body())
                    yield DONE
                    return
                elif isinstance(event, Finish):
                    if event.reason == "cancelled":
                        status = CLIENT_GONE
                        return
                    yield sse(shape.chunk(None, finish_reason=event.reason))
                    if include_usage:
                        yield sse(shape.usage_chunk(len(job.params.prompt_ids), event.completion_tokens))
                    yield DONE
                    return
                event = await job.next_event()
        except ClientGone:
            status = CLIENT_GONE
        finally:
            job.cancel.set()
            count(request, status)

    return app


def generation_error(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, SwarmError):
        return from_swarm_error(error)
    logger.error("generation failed unexpectedly", exc_info=error)
    return internal_error(error)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"the request body has {declared} bytes, over this server's limit of {limit}", code="request_too_large"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, f"the request body is over this server's limit of {limit} bytes", code="request_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def watch_disconnect(request: Request, gone: asyncio.Event) -> None:
    """Set `gone` when the client disconnects (read after the body, `receive` only says that)."""
    with contextlib.suppress(Exception):
        while (await request.receive())["type"] != "http.disconnect":
            pass
    gone.set()


def block_ranges(blocks: list[int]) -> list[str]:
    """[2, 3, 7] -> ["2:4", "7:8"]."""
    spans: list[list[int]] = []
    for block in blocks:
        if spans and spans[-1][1] == block:
            spans[-1][1] = block + 1
        else:
            spans.append([block, block + 1])
    return [f"{start}:{end}" for start, end in spans]


class EventStream(StreamingResponse):
    """Server-sent events from an async iterator; `on_close` runs however the stream ends.

    Disconnects are watched by the request's own watcher (not by reading `receive` here as Starlette does):
    it stops the iterator, and a send to a closed connection ends the stream too.
    """

    def __init__(self, events, on_close):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-send
            pass
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            self.on_close()
