"""Every example of docs/gateway.md, run against a real gateway process: each HTTP exchange
gets the documented status, headers and JSON shape (the same fields, recursively), the
SSE example's frames come in its order with its fields, and the mounting example serves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import web
from helpers import ROOT, GatewayProcess, free_port, sse_frames, wait_for

import subengine
from subengine import NewEvent

GATEWAY = (ROOT / "docs" / "gateway.md").read_text()
TIMEOUT = httpx.Timeout(30.0)


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GATEWAY, flags=re.DOTALL)


def shape(value: Any) -> Any:
    """The fields of a JSON value, recursively (a list by its first element)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__ if value is not None else None


def same_shape(documented: Any, got: Any) -> bool:
    if isinstance(documented, dict):
        return (
            isinstance(got, dict)
            and set(documented) == set(got)
            and all(same_shape(documented[k], got[k]) for k in documented)
        )
    if isinstance(documented, list):
        return isinstance(got, list) and (
            not documented or not got or same_shape(documented[0], got[0])
        )
    # a documented null may be a value in the run, and the other way round
    return documented is None or got is None or documented == got


def exchange(block: str) -> tuple[str, str, dict[str, str], str, int, list[str], str]:
    request, response = re.split(r"\n(?=HTTP/1\.1 )", block.strip(), maxsplit=1)
    head, _, body = request.strip().partition("\n\n")
    request_line, *header_lines = head.split("\n")
    method, path = request_line.split(" ")
    request_headers = dict(line.split(": ", 1) for line in header_lines)
    status_line, *rest = response.split("\n")
    response_head, _, response_body = "\n".join(rest).partition("\n\n")
    names = [line.split(":", 1)[0] for line in response_head.split("\n") if line]
    return method, path, request_headers, body, int(status_line.split()[1]), names, response_body


@pytest.fixture
def documented(engine: subengine.Engine, cli_env: dict[str, str], tmp_path: Path) -> Any:
    engine.create_stream("orders", 4)
    engine.create_stream("payments", 2)
    engine.append(
        "orders",
        [
            NewEvent("order-1", "OrderPlaced", {"total": 10}),
            NewEvent("order-1", "OrderPaid", {"total": 10}),
        ],
    )
    engine.append("payments", [NewEvent("pay-1", "Paid", {"total": 10})])
    with GatewayProcess(cli_env, tmp=tmp_path) as gateway:
        yield gateway


def test_every_http_example_gets_the_documented_answer(documented: GatewayProcess) -> None:
    examples = blocks("http")
    assert len(examples) >= 5
    for example in examples:
        method, path, headers, body, status, names, response_body = exchange(example)
        answer = web.request(
            method,
            documented.url + path,
            headers=headers,
            content=body.encode() or None,
            timeout=TIMEOUT,
        )
        assert answer.status_code == status, (example, answer.text)
        for name in names:
            assert name.lower() in answer.headers, (example, name)
        if response_body.strip():
            expected = json.loads(response_body)
            assert same_shape(shape(expected), shape(answer.json())), (example, answer.text)


def test_the_sse_example_is_what_a_stream_sends(documented: GatewayProcess) -> None:
    (example,) = blocks("sse")
    documented_frames = [f for f in sse_frames(iter(example.split("\n"))) if f.kind != ":"]
    got = []
    with web.stream(
        "GET",
        f"{documented.url}/v1/streams/orders/events",
        params={"live": "sse", "heartbeat": "1"},
        timeout=TIMEOUT,
    ) as response:
        lines = response.iter_lines()
        assert next(lines) == "retry: 1000"
        for frame in sse_frames(lines):
            got.append(frame)
            if frame.kind == ":":
                break
    assert [f.kind for f in got] == [f.kind for f in documented_frames] + [":"]
    for mine, theirs in zip(documented_frames, got, strict=False):
        assert same_shape(shape(mine.data), shape(theirs.data))
        assert (mine.id is None) == (theirs.id is None)


def test_the_mounting_example_serves_the_gateway(
    documented: GatewayProcess, cli_env: dict[str, str], tmp_path: Path
) -> None:
    (example, *_) = [block for block in blocks("python") if "Mount(" in block]
    (tmp_path / "myapp.py").write_text(example)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "myapp:app", "--port", str(port)],
        cwd=tmp_path,
        env=cli_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def listed() -> bool:
            try:
                answer = web.get(f"http://127.0.0.1:{port}/events/v1/streams", timeout=5)
            except httpx.TransportError:
                return False
            return answer.status_code == 200

        wait_for(listed, "the mounted gateway", timeout=30)
        answer = web.get(f"http://127.0.0.1:{port}/events/v1/streams", timeout=TIMEOUT)
        assert [s["name"] for s in answer.json()["streams"]] == ["orders", "payments"]
    finally:
        server.terminate()
        server.wait(30)
