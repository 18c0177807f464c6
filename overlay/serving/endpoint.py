"""`GET /v1/moe`: every MoE layer's backend, kernel, layout and reason, from the engine itself.

The API server process holds no model, so the table is gathered from the workers through
vLLM's collective_rpc (the worker method is installed by the general plugin).
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..patches.plugin import DISABLE_ENV, RPC_METHOD
from . import access, lifecycle

RPC_TIMEOUT_S = 30.0


class MoEEndpoint:
    """Factory target of the `vllm.endpoint_plugins` entry point `moe_overlay_endpoint`."""

    name = "moe_overlay_endpoint"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.add_api_route("/v1/moe", self.describe, methods=["GET"])
        app.add_middleware(lifecycle.EndResponsesWhenEngineStops)
        if access.install(app):  # vLLM's own key check leaves most non-/v1 routes open
            print(f"[moe-overlay] {access.API_KEY_ENV} is set: every route requires the API key", flush=True)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        state.moe_overlay_engine = engine_client
        lifecycle.watch(engine_client)  # for the exit status, should the engine die

    async def describe(self, request: Request) -> JSONResponse:
        engine = getattr(request.app.state, "moe_overlay_engine", None)
        if engine is None:
            return JSONResponse({"error": "this server has no engine to ask"}, status_code=503)
        try:
            per_worker = await engine.collective_rpc(RPC_METHOD, timeout=RPC_TIMEOUT_S)
        except Exception as err:  # the engine answers NotImplementedError when the overlay is off
            return JSONResponse(
                {"error": f"moe-overlay is not active in the engine ({type(err).__name__}: {err}); "
                          f"it is off when {DISABLE_ENV}=1 or VLLM_PLUGINS omits moe_overlay"},
                status_code=503,
            )
        layers = [{"worker": rank, **row} for rank, rows in enumerate(per_worker) for row in rows]
        return JSONResponse({"layers": layers})
