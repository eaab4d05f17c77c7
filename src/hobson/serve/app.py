"""The HTTP application: a loaded decider behind ``/v1/decide``, ``/healthz`` and ``/v1/model``.

Starlette (an ASGI framework) parses HTTP; uvicorn serves it (``jobs/serve.py``). The server
listens before the checkpoint is loaded, so a job's address is known at once; ``/healthz`` says
``loading`` (503) until the checkpoint's bytes verified and the model is built, then ``ready``.

Every error a client can cause is a JSON ``{"error", "field"}`` with a 4xx code: 400 for a body
that is not what :mod:`hobson.serve.questions` accepts (the field named), too large, or a
question longer than ``max_batch_tokens`` on its own; 401 without the bearer token when one is
set; 408 for a body that does not arrive within the request timeout; 429 with ``Retry-After``
when the queue is full; 503 with ``Retry-After`` while loading. A request only reads the model:
nothing a client sends changes what the next client gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hobson import faults
from hobson.serve.batching import Batcher, Question, QueueFull
from hobson.serve.questions import RequestError, parse_body

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServeSettings:
    """What ``jobs/serve.py``'s flags set; ranges are checked there."""

    checkpoint: str
    device: str = "cpu"
    base_model: str | None = None
    max_batch_tokens: int = 8192
    max_queue: int = 1024  # questions held (queued or in the running forward)
    max_questions: int = 256  # per request
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 60.0
    batch_wait_ms: float = 2.0
    token: str | None = None  # bearer token guarding /v1/*; None: no auth


class Service:
    """The loaded decider, its batcher, and what ``/v1/model`` tells about them."""

    def __init__(self, settings: ServeSettings, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.settings = settings
        self.on_failure = on_failure
        self.loaded: Any = None
        self.error: str | None = None
        self.batcher: Batcher | None = None
        self.info: dict[str, Any] = {"checkpoint": str(Path(settings.checkpoint).resolve())}
        self._collator: Any = None

    # -- loading (a thread, so the server answers /healthz meanwhile) --
    def start_loading(self) -> threading.Thread:
        t = threading.Thread(target=self._load, name="serve-load", daemon=True)
        t.start()
        return t

    def _load(self) -> None:
        from hobson.decider.predict import load_decider

        s = self.settings
        faults.hold("serve-load")  # TEST-ONLY: a test sees the server answer while it loads
        try:
            loaded = load_decider(s.checkpoint, s.device, s.base_model)
        except BaseException as e:  # noqa: BLE001 - reported by /healthz and the job's exit code
            self.error = str(e) or type(e).__name__
            if self.on_failure is not None:
                self.on_failure(e)
            return
        cfg = loaded.config
        config_file = Path(s.checkpoint) / "config.json"
        self.info.update({
            "config_sha256": hashlib.sha256(config_file.read_bytes()).hexdigest(),
            "temperatures": loaded.temperatures,
            "torso": cfg.base_model,
            "head": cfg.head_type,
            "max_length": cfg.max_length,
            "device": str(loaded.device),
            "max_batch_tokens": s.max_batch_tokens,
            "max_queue": s.max_queue,
            "max_questions": s.max_questions,
        })
        self._collator = loaded.collator()
        self.batcher = Batcher(self._answer, s.max_batch_tokens, s.max_queue, s.batch_wait_ms / 1000)
        self.batcher.start()
        self.loaded = loaded  # last: ready only once everything above is in place

    # -- the work --
    def lengths(self, rows: list[dict[str, Any]], where: list[str]) -> list[int]:
        """Rendered token counts; a question whose instruction and options alone exceed the
        checkpoint's max_length (its state is cut to fit, they never are) is a bad request."""
        from hobson.decider.predict import rendered_lengths
        from hobson.errors import DataError

        out = []
        for row, w in zip(rows, where, strict=True):
            try:
                out.extend(rendered_lengths(self.loaded, [row]))
            except DataError as e:
                raise RequestError(f"{w}.options" if w else "options",
                                   str(e).replace("training row 0: ", "")) from None
        return out

    def _answer(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One forward: the rows' calibrated probabilities, as ``ask`` computes them."""
        from hobson.decider.metrics import argmax
        from hobson.decider.predict import batch_logits, row_temperature, softmax

        out = []
        for row, z in zip(rows, batch_logits(self.loaded, rows, self._collator), strict=True):
            t = row_temperature(self.loaded.temperatures, row["kind"])
            p = softmax(z, t)
            best = argmax(p)
            out.append({"probabilities": p, "choice": row["options"][best][0], "choice_index": best,
                        "temperature": t})
        return out

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.stop()


def _error(status: int, field: str | None, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": message, "field": field}, status_code=status, headers=headers)


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError("body", f"{declared} bytes, more than the server's limit of {limit} bytes "
                                   "(--max-body-bytes); send fewer questions per request")
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError("body", f"more than the server's limit of {limit} bytes (--max-body-bytes); "
                                           "send fewer questions per request")
            chunks.append(chunk)

    await asyncio.wait_for(read(), timeout_s)
    return b"".join(chunks)


def _settle(fut: asyncio.Future, answer: Any, error: BaseException | None) -> None:
    if fut.done():  # the request timed out or its client left
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(answer)


async def healthz(request: Request) -> Response:
    svc: Service = request.app.state.service
    if svc.error is not None:
        return JSONResponse({"status": "failed", "error": svc.error}, status_code=503)
    if svc.loaded is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    assert svc.batcher is not None
    return JSONResponse({"status": "ready", "queued": svc.batcher.held(), "stats": svc.batcher.stats.as_dict()})


async def model(request: Request) -> Response:
    svc: Service = request.app.state.service
    if svc.loaded is None:
        return _error(503, None, svc.error or "the checkpoint is still loading", RETRY_AFTER_S)
    return JSONResponse(svc.info)


async def decide(request: Request) -> Response:
    svc: Service = request.app.state.service
    s = svc.settings
    if svc.loaded is None:
        return _error(503, None, svc.error or "the checkpoint is still loading; retry", RETRY_AFTER_S)
    try:
        body = await _read_body(request, s.max_body_bytes, s.request_timeout_s)
        rows, where = parse_body(body, s.max_questions)
        lengths = await run_in_threadpool(svc.lengths, rows, where)
    except RequestError as e:
        return _error(400, e.field, str(e))
    except TimeoutError:
        return _error(408, "body", f"the body did not arrive within {s.request_timeout_s:g} s")
    for row, n, w in zip(rows, lengths, where, strict=True):
        if n > s.max_batch_tokens:
            return _error(400, w or "body", f"renders to {n} tokens, more than the server's --max-batch-tokens="
                                      f"{s.max_batch_tokens}; shorten its state or ask a server with a larger cap")
        cfg = svc.loaded.config
        if cfg.head_type == "slot" and len(row["options"]) > cfg.num_slots:
            return _error(400, f"{w}.options" if w else "options",
                          f"{len(row['options'])} options, but this checkpoint's slot head has "
                          f"num_slots={cfg.num_slots}")
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in rows]

    def deliverer(fut: asyncio.Future) -> Callable[[Any, BaseException | None], None]:
        return lambda answer, error: loop.call_soon_threadsafe(_settle, fut, answer, error)

    assert svc.batcher is not None
    try:
        svc.batcher.submit([Question(r, n, deliverer(f)) for r, n, f in zip(rows, lengths, futures, strict=True)])
    except QueueFull as e:
        return _error(429, None, f"the server is busy ({e}); retry after {RETRY_AFTER_S} s", RETRY_AFTER_S)
    try:
        answers = await asyncio.wait_for(asyncio.gather(*futures), s.request_timeout_s)
    except TimeoutError:
        return _error(503, None, f"no answer within {s.request_timeout_s:g} s (--request-timeout); the server "
                                 "is overloaded", RETRY_AFTER_S)
    except Exception as e:  # noqa: BLE001 - a failed forward: this request fails, the server stays up
        return _error(500, None, f"the forward failed: {type(e).__name__}: {e}")
    return JSONResponse({"answers": answers})


def _guard(token: str | None, endpoint: Callable[[Request], Any]) -> Callable[[Request], Any]:
    if token is None:
        return endpoint
    expected = f"Bearer {token}".encode()

    async def guarded(request: Request) -> Response:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return JSONResponse({"error": "missing or wrong bearer token (Authorization: Bearer ...)",
                                 "field": "Authorization"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return await endpoint(request)

    return guarded


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, None, f"{request.method} {request.url.path}: {exc.detail}")


async def _internal(request: Request, exc: Exception) -> Response:
    return _error(500, None, f"internal error: {type(exc).__name__}: {exc}")


def build_app(service: Service) -> Starlette:
    """The ASGI app; loading starts with the server and the batcher drains when it stops."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.start_loading()
        try:
            yield
        finally:
            await run_in_threadpool(service.close)

    token = service.settings.token
    app = Starlette(
        routes=[Route("/healthz", healthz, methods=["GET"]),
                Route("/v1/model", _guard(token, model), methods=["GET"]),
                Route("/v1/decide", _guard(token, decide), methods=["POST"])],
        exception_handlers={HTTPException: _http_error, Exception: _internal},
        lifespan=lifespan,
    )
    app.state.service = service
    return app
