"""What the gateway tests share: a tiny tokenizer, a fake engine, servers on loopback.

The fake engine is a real HTTP server (uvicorn on 127.0.0.1) that speaks the
part of vLLM's API the gateway uses (``/health``, ``/v1/models``,
``/v1/completions`` with token-id prompts, SSE streams) and records what it
was sent. It stands in for vLLM only where a test is about the gateway
itself; tests/engines/ run the gateway in front of real vLLM engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh.engine_hash import EngineHasher
from kvmesh.gateway.app import EngineCheck, Gateway, create_app
from kvmesh.gateway.config import EngineTarget, GatewayConfig
from kvmesh.gateway.tokenizer import PromptTokenizer
from kvmesh.security import TenantPolicy

MODEL = "tiny-test-model"
BLOCK = 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, a system prompt for every turn of a long conversation",
    "user assistant system: answer briefly and politely",
]


def build_tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer with a chat template, saved as the engines' folder holds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


@dataclass
class FakeEngine:
    """A vLLM-shaped engine that answers from the prompt it got and records every request.

    `sick`: /health answers 503. `hang_s`: completions wait this long first.
    `chunks`: SSE chunks per streamed answer. `cached`: prompt tokens it reports cached in
    ``usage.prompt_tokens_details`` (as vLLM with ``--enable-prompt-tokens-details``; streams
    end with a usage chunk when asked ``stream_options.include_usage``); None: no details.
    """

    name: str
    sick: bool = False
    hang_s: float = 0.0
    chunks: int = 3
    cached: int | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=503 if self.sick else 200)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.seen.append(body)
            if self.hang_s:
                await asyncio.sleep(self.hang_s)
            prompt = body.get("prompt")
            if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
                return JSONResponse(
                    {"error": {"message": "engine wants token ids", "type": "BadRequest"}},
                    status_code=400,
                )
            if body.get("max_tokens") == 0:
                return JSONResponse(
                    {"error": {"message": "max_tokens must be at least 1", "code": 400}},
                    status_code=400,
                )
            text = f"{self.name}:{len(prompt)}"
            usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": 1}
            if self.cached is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
            if not body.get("stream"):
                return JSONResponse(
                    {
                        "id": "cmpl-1",
                        "object": "text_completion",
                        "created": 1,
                        "model": body["model"],
                        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                        "usage": usage,
                    }
                )

            async def events() -> AsyncIterator[bytes]:
                for i in range(self.chunks):
                    last = i == self.chunks - 1
                    chunk = {
                        "id": "cmpl-1",
                        "object": "text_completion",
                        "created": 1,
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "text": f"{text}#{i}",
                                "finish_reason": "length" if last else None,
                            }
                        ],
                    }
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                    await asyncio.sleep(0.01)
                if (body.get("stream_options") or {}).get("include_usage"):
                    final = {"id": "cmpl-1", "choices": [], "usage": usage}
                    yield b"data: " + json.dumps(final).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class Served:
    """An app served on loopback in this event loop; `stop` closes its listening socket."""

    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 10)


async def serve(app: FastAPI) -> Served:
    sock = _free_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="auto", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 10
    while not server.started:
        if task.done():
            task.result()
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start in 10 s")
        await asyncio.sleep(0.01)
    return Served(f"http://127.0.0.1:{port}", server, task)


@dataclass
class Setup:
    """Fake engines and a gateway in front of them, all served on loopback."""

    gateway: Gateway
    url: str
    engines: dict[str, FakeEngine]
    servers: dict[str, Served]

    async def kill(self, name: str) -> None:
        """Stop engine `name`'s server: its port refuses connections from now on."""
        await self.servers[name].stop()


def make_gateway(
    engines: Sequence[FakeEngine],
    tokenizer: PromptTokenizer,
    tenants: TenantPolicy | None = None,
    verify: EngineCheck | None = None,
    **config: Any,
) -> Gateway:
    specs = tuple(EngineTarget(e.name, e.url) for e in engines)
    config.setdefault("health_interval_s", 0.2)
    hasher = EngineHasher(block_size=BLOCK)
    return Gateway(
        GatewayConfig(specs, **config), tokenizer, hasher, tenants=tenants, verify=verify
    )


@contextlib.asynccontextmanager
async def engines_and_gateway(
    engines: Sequence[FakeEngine], tokenizer: PromptTokenizer, **config: Any
) -> AsyncIterator[Setup]:
    """Serve `engines` and a gateway in front of them."""
    servers = {e.name: await serve(e.app()) for e in engines}
    for e in engines:
        e.url = servers[e.name].url
    gateway = make_gateway(engines, tokenizer, **config)
    front = await serve(create_app(gateway))
    try:
        yield Setup(gateway, front.url, {e.name: e for e in engines}, servers)
    finally:
        await front.stop()
        for s in servers.values():
            if not s.task.done():
                await s.stop()
