"""errors.install_error_handlers under a real uvicorn: an unexpected error is a 500 in OpenAI's
shape that closes its connection, so the client's next request goes out on a new one."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI

from pagedllm.entrypoints.openai.errors import install_error_handlers
from tests.entrypoints.openai.conftest import free_port


def test_the_request_after_a_500_is_answered():
    """h61's fuzzer: after each 500 (a RecursionError then), the client's next request on the kept-alive
    connection failed with "connection reset by peer": uvicorn closes a connection whose app raised
    (Starlette re-raises after sending the handler's answer), and the answer had not said so."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(3):
                r = client.get("/boom")
                assert r.status_code == 500 and r.headers["connection"] == "close"
                assert r.json()["error"]["message"] == "Internal server error: RuntimeError: boom"
                assert client.get("/ok").json() == {"ok": True}
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_unknown_field_is_named_as_sent():
    """h61's fuzzer: {"": 1} on a pooling endpoint (extra fields forbidden) read "Invalid value for
    'None': Extra inputs are not permitted"."""
    from pydantic import BaseModel, ConfigDict, ValidationError

    from pagedllm.entrypoints.openai.errors import from_validation_error

    class Body(BaseModel):
        model_config = ConfigDict(extra="forbid")
        a: int = 0

    class Outer(BaseModel):
        model_config = ConfigDict(extra="forbid")
        inner: Body | None = None

    for raw, message, param in [('{"": 1}', "Unknown field '': this endpoint does not take it.", None),
                                ('{"nope": 1}', "Unknown field 'nope': this endpoint does not take it.", "nope"),
                                ('{"inner": {"x": 1}}', "Unknown field 'x' in inner", "inner.x")]:
        try:
            Outer.model_validate_json(raw)
        except ValidationError as e:
            err = from_validation_error(e)
        assert err.message.startswith(message) and err.param == param, (err.message, err.param)


def test_a_union_field_is_named_without_its_member_tag():
    """`prompt: null` read "Invalid value for 'prompt.str'" with param "prompt.str": pydantic tags the
    union's plain members (("prompt", "str")), which are no field of the request."""
    from pydantic import ValidationError

    from pagedllm.entrypoints.openai.errors import from_validation_error
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    for model, raw, param in [(CompletionRequest, '{"prompt": null}', "prompt"),
                              (CompletionRequest, '{"prompt": ["a", [1]]}', "prompt"),
                              (CompletionRequest, '{"prompt": "a", "stop": 5}', "stop"),
                              (ChatCompletionRequest, '{"messages": [], "tool_choice": 5}', "tool_choice"),
                              (CompletionRequest, '{"prompt": "a", "stream_options": {"include_usage": 1}}',
                               "stream_options.include_usage")]:
        try:
            model.model_validate_json(raw)
        except ValidationError as e:
            err = from_validation_error(e)
        assert err.param == param and err.message.startswith(f"Invalid value for '{param}':"), (err.message, err.param)
