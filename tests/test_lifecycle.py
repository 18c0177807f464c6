"""The server's side of an engine that stops, without a server: open responses are ended once the
engine has stopped (a stream with an error event, a response not started with a 503), others pass
untouched; the exit status tells a dead engine from a stop. Served: tests/test_faults.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from moe_overlay.serving import lifecycle


class FakeEngine:
    def __init__(self) -> None:
        self.errored = False
        self.output_handler: asyncio.Task | None = None


@pytest.fixture
def engine(monkeypatch):
    fake = FakeEngine()
    monkeypatch.setattr(lifecycle, "_engine", fake)
    monkeypatch.setattr(lifecycle, "POLL_S", 0.01)
    return fake


async def _call(app, engine: FakeEngine, stop_after: float | None) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def stop() -> None:
        if stop_after is not None:
            await asyncio.sleep(stop_after)
            engine.errored = True

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    await asyncio.wait_for(asyncio.gather(lifecycle.EndResponsesWhenEngineStops(app)(scope, receive, send), stop()), 5)
    return sent


async def _endless_stream(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
    await asyncio.sleep(3600)  # vLLM's stream after the engine stopped: nothing more ever comes


async def _never_starts(scope, receive, send) -> None:
    await asyncio.sleep(3600)


async def _answers(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


def test_an_open_stream_ends_with_an_error_event_once_the_engine_stopped(engine):
    sent = asyncio.run(_call(_endless_stream, engine, stop_after=0.05))
    last = sent[-1]
    assert last["type"] == "http.response.body" and last["more_body"] is False
    event = json.loads(last["body"].decode().removeprefix("data: "))
    assert event["error"]["message"] == lifecycle.STOPPED and event["error"]["code"] == 503


def test_a_response_not_started_is_a_503(engine):
    sent = asyncio.run(_call(_never_starts, engine, stop_after=0.05))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    assert lifecycle.STOPPED in sent[-1]["body"].decode()


def test_a_running_engine_changes_nothing(engine):
    sent = asyncio.run(_call(_answers, engine, stop_after=None))
    assert [m.get("body") for m in sent] == [None, b"ok"] and sent[0]["status"] == 200


ENGINE_DEAD = b'data: {"error": {"message": "EngineCore encountered an issue.", "code": 500}}\n\n'


def _reporting_stream(engine: FakeEngine, stop_first: bool, tail: list[bytes]):
    """vLLM's stream when its engine goes away under it: the events it still had, then `tail`."""
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        engine.errored = stop_first
        for body in tail:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


def test_vllms_engine_dead_event_is_replaced_by_the_overlays_ending(engine):
    sent = asyncio.run(_call(_reporting_stream(engine, True, [ENGINE_DEAD]), engine, stop_after=None))
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies[0] == b'data: {"choices": []}\n\n' and len(bodies) == 2  # no [DONE] after the ending
    event = json.loads(bodies[1].decode().removeprefix("data: "))
    assert event["error"]["message"] == lifecycle.STOPPED and sent[-1]["more_body"] is False


def test_events_after_the_stop_that_report_no_failure_pass_and_a_running_engines_errors_too(engine):
    tail = [b'data: {"choices": [{"finish_reason": "length"}]}\n\n']  # a drained request's last event
    sent = asyncio.run(_call(_reporting_stream(engine, True, tail), engine, stop_after=None))
    assert [m["body"] for m in sent[1:]] == [b'data: {"choices": []}\n\n', *tail, b"data: [DONE]\n\n"]
    engine.errored = False
    sent = asyncio.run(_call(_reporting_stream(engine, False, [ENGINE_DEAD]), engine, stop_after=None))
    assert [m["body"] for m in sent[1:]] == [b'data: {"choices": []}\n\n', ENGINE_DEAD, b"data: [DONE]\n\n"]


def test_a_server_error_response_on_a_stopped_engine_becomes_the_503(engine):
    async def fails(scope, receive, send) -> None:
        engine.errored = True
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": "EngineCore encountered an issue."}'})

    sent = asyncio.run(_call(fails, engine, stop_after=None))
    assert sent[0]["status"] == 503 and len(sent) == 2 and lifecycle.STOPPED in sent[1]["body"].decode()


def _finished_task(cancel: bool) -> asyncio.Task:
    async def make() -> asyncio.Task:
        task = asyncio.ensure_future(asyncio.sleep(3600 if cancel else 0))
        if cancel:
            task.cancel()
        await asyncio.wait({task})
        return task

    return asyncio.run(make())


def test_exit_status_tells_a_dead_engine_from_a_stop(monkeypatch, capsys):
    monkeypatch.setattr(lifecycle, "_engine", None)
    assert lifecycle.exit_status() == 0  # no engine was watched
    monkeypatch.setattr(lifecycle, "_engine", SimpleNamespace(output_handler=_finished_task(cancel=True)))
    assert lifecycle.exit_status() == 0  # a stop cancels the output loop
    monkeypatch.setattr(lifecycle, "_engine", SimpleNamespace(output_handler=_finished_task(cancel=False)))
    assert lifecycle.exit_status() == 1  # the loop ended on its own: the engine died
    assert "the engine process died while serving" in capsys.readouterr().err


class StoppingEngine:
    """An engine client whose shutdown kills the engine before it cancels the output loop, as
    AsyncLLM.shutdown does: the loop may fail on the dead engine before it is cancelled."""

    def __init__(self, died_first: bool) -> None:
        self.output_handler = _finished_task(cancel=False) if died_first else None
        self.shutdowns = 0

    def shutdown(self, timeout: float | None = None) -> None:
        self.shutdowns += 1
        self.output_handler = _finished_task(cancel=False)  # failed on the engine just killed


def test_exit_status_is_read_as_it_was_when_the_shutdown_was_asked_for(monkeypatch, capsys):
    monkeypatch.setattr(lifecycle, "_engine", None)
    monkeypatch.setattr(lifecycle, "_died_before_shutdown", None)
    stopped = StoppingEngine(died_first=False)
    lifecycle.watch(stopped)
    stopped.shutdown(timeout=0)  # SIGTERM: the loop ends on its own only during the shutdown
    assert stopped.shutdowns == 1 and lifecycle.engine_died()
    assert lifecycle.exit_status() == 0
    died = StoppingEngine(died_first=True)
    lifecycle.watch(died)
    died.shutdown()  # the teardown after the engine died under the server
    assert lifecycle.exit_status() == 1
    assert "the engine process died while serving" in capsys.readouterr().err
