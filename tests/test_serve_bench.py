"""benchmarks/serve.py's load-generating client (also the generation race's): plain and streamed answers read as
the server writes them, events split across chunks and several events in one chunk included."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/serve.py", "serve_bench")


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def answering(response: bytes, bench, run) -> tuple[bytes, object]:
    """Start a one-shot server that reads a request and writes ``response``; ``run(client)``'s result and the
    request the server read."""
    seen = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        seen.append(head + await reader.readexactly(length))
        writer.write(response)
        await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, bench.RawClient(f"http://127.0.0.1:{port}") as client:
        result = await run(client)
    return seen[0], result


def test_events_are_read_across_chunk_boundaries(bench) -> None:
    body = chunked(b'data: {"token": "a"}\n\ndata: {"tok', b'en": "b"}\n', b"\n", b'data: {"text": "ab"}\n\n')
    response = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body

    async def run(client):
        return [e async for e in client.events("/generate", b'{"prompt": "x"}')]

    request, events = asyncio.run(answering(response, bench, run))
    assert events == [b'{"token": "a"}', b'{"token": "b"}', b'{"text": "ab"}']
    assert request.startswith(b"POST /generate HTTP/1.1\r\n") and request.endswith(b'{"prompt": "x"}')


def test_an_error_answer_is_not_read_as_events(bench) -> None:
    response = b'HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n{}'

    async def run(client):
        with pytest.raises(RuntimeError, match="expected a chunked 200"):
            async for _ in client.events("/generate", b"{}"):
                pass
        return None

    asyncio.run(answering(response, bench, run))


def test_post_reads_a_whole_answer(bench) -> None:
    response = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok": 1}\r\n'

    async def run(client):
        return await client.post("/translate", b"{}")

    _, (status, data) = asyncio.run(answering(response, bench, run))
    assert status == 200 and data == b'{"ok": 1}\r\n'
