"""The monitor's HTTP server: the page (static/), `GET /api/state` (the document of swarm/dht/state.py), `GET /health`.

The page is the same for every swarm; all swarm data reaches the browser as JSON, which the page's script turns
into text nodes. A Content-Security-Policy allows only this server's own script and style as a second line of
defence: even markup that slipped into the page could load or run nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

logger = logging.getLogger(__name__)

_STATIC = {  # path -> (file under static/, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/monitor.js": ("monitor.js", "text/javascript; charset=utf-8"),
    "/monitor.css": ("monitor.css", "text/css; charset=utf-8"),
}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def static_file(name: str) -> str:
    return resources.files("client.monitor").joinpath("static", name).read_text(encoding="utf-8")


def create_app(make_watcher: Callable[[], Any], refresh_s: float) -> FastAPI:
    """The ASGI app. `make_watcher()` is called on the server's event loop at startup; the watcher (a
    client.monitor.watcher.Watcher or a stand-in with `state`, `run()` and `close()`) runs until shutdown."""
    pages = {path: (static_file(name), media) for path, (name, media) in _STATIC.items()}
    # the page learns how often to poll from its own markup: a number we format, nothing from the swarm
    html, media = pages["/"]
    pages["/"] = (html.replace("{{REFRESH_S}}", f"{refresh_s:g}"), media)
    holder: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = holder["watcher"] = make_watcher()
        task = asyncio.create_task(watcher.run(), name="monitor-watcher")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await watcher.close()

    app = FastAPI(title="swarmlm monitor", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    for path, (body, media) in pages.items():
        app.add_api_route(path, _page(body, media), methods=["GET"], include_in_schema=False)

    @app.get("/api/state")
    async def api_state() -> Response:
        state = holder["watcher"].state
        if state is None:  # the first refresh is still under way
            return JSONResponse(
                {"error": "the first read of the swarm is still under way"},
                status_code=503,
                headers={**_HEADERS, "Retry-After": "1"},
            )
        return JSONResponse(state, headers=_HEADERS)

    @app.get("/health")
    async def health() -> Response:
        ready = holder["watcher"].state is not None
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503, headers=_HEADERS)

    return app


def _page(body: str, media: str) -> Callable[[], Any]:
    async def serve() -> Response:
        return Response(body, media_type=media, headers=_HEADERS)

    return serve
