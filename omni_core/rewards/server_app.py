"""`omniflow reward-server`: OmniFlow's own reward terms served over HTTP in the JSON wire format (`wire_format`).

The server builds one `RewardManager` from a `reward` config section (built-ins, reward files, model rewards on
this machine's device) and answers

  POST /score   a JSON request -> `{"scores", "extras", "errors"}`: a sample whose reward failed gets a null score
                and the manager's reason; a request that breaks the format gets HTTP 400 `{"error": reason}`
  GET  /health  `{"status": "ok", "format": "json", "terms": [labels], "mode": ...}`

Scoring calls run one at a time in a worker thread (a reward model on one device gains nothing from overlapping
calls, and the manager's deadline runner serves one caller), so the event loop keeps answering /health meanwhile.
It runs under uvicorn; the default host is 127.0.0.1 (reachable from this machine only: pass --host 0.0.0.0 to serve
other machines, behind your own network controls, since the server runs reward code on the images it is sent).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from omni_core.rewards.manager import RewardManager
from omni_core.rewards.wire_format import JSON_FORMAT, WireFormatError, json_response, parse_json_request

__all__ = ["create_app", "serve"]

logger = logging.getLogger(__name__)


def _mode(manager: RewardManager) -> str:
    if not manager.terms:
        return "data_source"
    return "weighted_sum"


def create_app(manager: RewardManager) -> Starlette:
    """The ASGI app serving `manager`'s reward terms."""
    lock = threading.Lock()
    labels = [t.label for t in manager.terms]

    def score_locked(images: list, prompts: list, metadata: list[dict[str, Any]]) -> dict[str, Any]:
        n = len(images)
        with lock:
            try:
                result = manager.score(
                    images,
                    [str(m.get("data_source") or "") for m in metadata],
                    [m.get("ground_truth") for m in metadata],
                    [m.get("extra_info") or {} for m in metadata],
                    prompts=prompts,
                )
            except Exception as exc:  # e.g. a data_source without a built-in reward: every sample fails with why
                reason = f"reward: {type(exc).__name__}: {exc}"
                return {"scores": [None] * n, "extras": [{}] * n, "errors": [reason] * n}
        return json_response(result.scores.tolist(), result.failed.tolist(), result.reasons, result.extras)

    async def score(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            images, prompts, metadata = parse_json_request(body)
        except WireFormatError as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        answer = await anyio.to_thread.run_sync(score_locked, images, prompts, metadata)
        return JSONResponse(answer)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "format": JSON_FORMAT.name, "terms": labels, "mode": _mode(manager)})

    return Starlette(routes=[Route("/score", score, methods=["POST"]), Route("/health", health, methods=["GET"])])


def serve(reward_cfg: Any, device: str | None, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Load the reward terms (models once), bind `host:port` (0 picks a free port), print the address, serve until
    SIGINT / SIGTERM."""
    import uvicorn

    manager = RewardManager(reward_cfg, device=device)
    app = create_app(manager)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    labels = ", ".join(t.label for t in manager.terms) or "built-ins by data_source"
    # One line a script (or a test) can wait for; flushed before uvicorn starts accepting.
    print(f"omniflow reward-server: serving [{labels}] on http://{host}:{bound}/score (GET /health)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
