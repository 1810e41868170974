"""Reward servers over real HTTP on 127.0.0.1: `omniflow reward-server` as a subprocess, small in-test servers for
the client's retries (408, 429, 5xx, a hung attempt; not 400), headers, URL credentials and flow_grpo's pickle
format, and one training run whose reward is served behind a bearer token that none of its records may hold."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from PIL import Image
from real_prefect import run_log_messages
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from omni_core.rewards.manager import RewardManager
from omni_core.rewards.wire_format import restricted_loads

SERVED_REWARD = """
import io, json, os, time
from PIL import Image

def compute_score(data_source, solution_image, ground_truth, extra_info):
    mode = extra_info.get("mode")
    if mode == "fail":
        raise ValueError("no text found in the image")
    if mode == "sleep":
        time.sleep(float(extra_info["seconds"]))
    hwc = solution_image.permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(hwc).save(buffer, format="JPEG", quality=95)
    score = -buffer.tell() / 1000 / 500
    log = os.environ.get("OMNIFLOW_TEST_REWARD_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"score": score, "height": int(hwc.shape[0])}) + "\\n")
    return {"score": score, "height": int(hwc.shape[0])}
"""
SECRET = "s3cr3t-token-do-not-log"
TOKEN_VAR = "OMNIFLOW_TEST_REWARD_TOKEN"
# The bearer token of the training run's reward server. Set when pytest imports this module (collection, before the
# session's Ray cluster starts), because Ray workers keep the environment their cluster started with: the run's
# rollout workers read `env:RUN_TOKEN_VAR` there, as a real run's workers read a variable exported where it starts.
RUN_SECRET = "run-b3arer-t0ken-n3ver-logged"
RUN_TOKEN_VAR = "OMNIFLOW_TEST_RUN_REWARD_TOKEN"
os.environ[RUN_TOKEN_VAR] = f"Bearer {RUN_SECRET}"


def _images(n: int, seed: int = 0, size: int = 24) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, 3, size, size), dtype=np.uint8))


def _server_entry(url: str, **keys) -> dict:
    return {"name": "srv", "server_url": url, **keys}


# ------------------------------------------------------------------------------------- omniflow reward-server
class RewardServerProcess:
    """`omniflow reward-server --port 0 ...` in a subprocess; its address read from the line it prints."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "omniflow.flows.cli", "reward-server", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout=90):
            self.stop()
            raise RuntimeError("reward server did not start:\n" + "".join(self.lines))
        address = self.lines[0].split(" on ", 1)[1].split()[0]  # http://127.0.0.1:PORT/score
        self.url = address
        self.base = address.rsplit("/", 1)[0]
        deadline = time.monotonic() + 30
        while True:  # bound and printed; accepting once /health answers
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("reward server /health never answered:\n" + "".join(self.lines))
            time.sleep(0.1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "omniflow reward-server: serving" in line:
                self._ready.set()
            if len(self.lines) == 1 and "serving" not in line and self.proc.poll() is not None:
                break
        self._ready.set()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[RewardServerProcess, Path, Path]]:
    """One `omniflow reward-server` for the module: a reward file that logs each score it computes."""
    d = tmp_path_factory.mktemp("served")
    reward, log = d / "served_reward.py", d / "scores.jsonl"
    reward.write_text(SERVED_REWARD)
    env = {**os.environ, "OMNIFLOW_TEST_REWARD_LOG": str(log)}
    server = RewardServerProcess([f"reward.reward_functions=[{{path: {reward}, name: served}}]", "trainer.device=cpu"], env)
    yield server, reward, log
    port = int(server.base.rsplit(":", 1)[1])
    server.stop()
    # SIGTERM is a clean stop: uvicorn's graceful shutdown runs to its end, then (uvicorn's rule) the process dies by
    # the signal it was sent: -15, not -9 from stop's kill after 15 s nor a traceback's 1; and the port is released.
    deadline = time.monotonic() + 30  # the reader thread may still be taking the last lines
    while not any("Finished server process" in line for line in server.lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any("Finished server process" in line for line in server.lines), "".join(server.lines)[-3000:]
    assert server.proc.returncode == -signal.SIGTERM, "".join(server.lines)[-3000:]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_served_scores_equal_local_scoring_and_failures_come_back_per_sample(served):
    server, reward, _ = served
    health = httpx.get(f"{server.base}/health").json()
    assert health == {"status": "ok", "format": "json", "terms": ["served"], "mode": "weighted_sum"}
    images = _images(5)
    infos = [{}, {"mode": "fail"}, {}, {}, {}]
    local = RewardManager({"reward_functions": [{"path": str(reward), "name": "served"}]}).score(images, "x", extra_infos=infos)
    remote = RewardManager({"reward_functions": [_server_entry(server.url, batch_size=2, max_concurrency=2)]}).score(
        images, "x", extra_infos=infos, prompts=[f"p{i}" for i in range(5)]
    )
    assert remote.failed.tolist() == local.failed.tolist() == [False, True, False, False, False]
    ok = ~local.failed
    assert torch.equal(remote.scores[ok], local.scores[ok])  # PNG is lossless: the same pixels, the same JPEG sizes
    assert remote.extras[0] == {"height": 24} == local.extras[0]
    # The server's reason for the one sample, behind the client term's label.
    assert remote.reasons[1] == "srv: server: served: ValueError: no text found in the image"


def test_a_slow_server_fails_the_batch_by_request_timeout_and_reward_timeout_bounds_a_batch_call(served):
    server, _, _ = served
    images = _images(2, seed=1)
    slow = [{"mode": "sleep", "seconds": 1.5}] * 2
    entry = _server_entry(server.url, request_timeout_s=0.4, max_retries=0, batch_size=2)
    start = time.monotonic()
    result = RewardManager({"reward_functions": [entry]}).score(images, "x", extra_infos=slow)
    assert time.monotonic() - start < 2.5  # gave up: the answer comes after 2 x 1.5 s of sleeping
    assert result.failed.all()
    assert result.reasons[0] == result.reasons[1]
    assert "no answer within request_timeout_s=0.4 s (ReadTimeout)" in result.reasons[0]
    assert result.reasons[0].startswith(f"srv: RewardServerError: {server.url}: no scores after 1 attempts")
    # reward.timeout_s bounds one batch call: batch 0 times out, batch 1 is not sent.
    patient = _server_entry(server.url, request_timeout_s=30, batch_size=1, max_concurrency=1)
    manager = RewardManager({"reward_functions": [patient], "timeout_s": 0.5})
    bounded = manager.score(images, "x", extra_infos=slow)
    assert bounded.reasons == [
        "srv: RewardTimeout: timed out after 0.5 s (reward.timeout_s)",
        "srv: RewardTimeout: not called: batch 0 of this call timed out after 0.5 s (reward.timeout_s)",
    ]
    assert manager._runner.abandoned == 1


def test_the_server_refuses_a_malformed_request_with_400_and_the_reason(served):
    server, _, _ = served
    bad = httpx.post(server.url, content=b'{"images": ["not base64 png"]}', headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "images[0] is not a base64-encoded image" in bad.json()["error"]


# ------------------------------------------------------------------------------------- in-test servers
class ThreadServer:
    """A starlette app under uvicorn in a thread of this process, on a free port of 127.0.0.1."""

    def __init__(self, app: Starlette) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "in-test server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class Scripted:
    """Endpoints with scripted behaviour; `seen` records what each received."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.seen: dict[str, list] = {}
        self.fail_first = 0
        self.fail_status = 503  # what /flaky answers to its first `fail_first` calls
        self.hang_s = 0.0  # how long /hang sleeps before answering its first call
        self.upstream = ""  # where /token_proxy sends what it lets through

    def _count(self, name: str) -> int:
        self.calls[name] = self.calls.get(name, 0) + 1
        return self.calls[name]

    async def auth(self, request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        self.seen.setdefault("auth", []).append(dict(request.headers))
        if request.headers.get("authorization") != f"Bearer {SECRET}":
            return JSONResponse({"error": "bad token"}, status_code=401)
        return JSONResponse({"scores": [1.0] * len(body["images"])})

    async def flaky(self, request: Request) -> JSONResponse:
        n = len(json.loads(await request.body())["images"])
        if self._count("flaky") <= self.fail_first:
            return JSONResponse({"error": "warming up"}, status_code=self.fail_status)
        return JSONResponse({"scores": [0.25] * n, "errors": [None] * n})

    async def hang(self, request: Request) -> JSONResponse:
        n = len(json.loads(await request.body())["images"])
        if self._count("hang") == 1:
            await asyncio.sleep(self.hang_s)  # past the client's request_timeout_s: it gives up on this attempt
        return JSONResponse({"scores": [0.5] * n})

    async def rejects(self, request: Request) -> JSONResponse:
        self._count("rejects")
        return JSONResponse({"error": "images must be at least 64 px"}, status_code=422)

    async def token_proxy(self, request: Request) -> Response:
        """A reward server behind a bearer token (`RUN_SECRET`): checks the token, then passes the batch on to
        `self.upstream` (the module's `omniflow reward-server`) and its answer back."""
        body = await request.body()
        allowed = request.headers.get("authorization") == f"Bearer {RUN_SECRET}"
        self.seen.setdefault("token_proxy", []).append(allowed)
        if not allowed:
            return JSONResponse({"error": "bad token"}, status_code=401)
        async with httpx.AsyncClient(timeout=120) as client:
            answer = await client.post(self.upstream, content=body, headers={"content-type": "application/json"})
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    async def flow_grpo(self, request: Request) -> Response:
        payload = restricted_loads(await request.body())  # the client sends plain types only
        self.seen.setdefault("pickle", []).append(payload)
        if "evil" in payload["prompts"]:
            return Response(pickle.dumps({"scores": [Evil()] * len(payload["images"])}))
        means = [float(np.asarray(Image.open(io.BytesIO(jpeg))).mean() / 255) for jpeg in payload["images"]]
        return Response(pickle.dumps({"scores": means}))

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/auth", self.auth, methods=["POST"]),
                Route("/flaky", self.flaky, methods=["POST"]),
                Route("/hang", self.hang, methods=["POST"]),
                Route("/rejects", self.rejects, methods=["POST"]),
                Route("/flow_grpo", self.flow_grpo, methods=["POST"]),
                Route("/token_proxy", self.token_proxy, methods=["POST"]),
            ]
        )


class Evil:
    """Unpickles into a call of os.getpid: a global the client's unpickler must refuse (and so never call)."""

    def __reduce__(self):
        return (os.getpid, ())


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[Scripted, str]]:
    state = Scripted()
    server = ThreadServer(state.app())
    yield state, server.base
    server.stop()


def test_retryable_answers_are_retried_with_backoff_and_client_errors_are_not(scripted):
    state, base = scripted
    state.fail_first, state.calls = 2, {}
    entry = _server_entry(f"{base}/flaky", max_retries=2, retry_backoff=0.1)
    start = time.monotonic()
    ok = RewardManager({"reward_functions": [entry]}).score(_images(3), "x")
    assert time.monotonic() - start >= 0.1 + 0.2  # waited 0.1 s, then 0.2 s (doubled) before the retries
    assert not ok.failed.any() and ok.scores.tolist() == [0.25] * 3 and state.calls["flaky"] == 3
    state.fail_first, state.calls = 5, {}
    gave_up = RewardManager({"reward_functions": [{**entry, "max_retries": 1}]}).score(_images(2), "x")
    assert gave_up.failed.all() and state.calls["flaky"] == 2
    assert gave_up.reasons[0].endswith("no scores after 2 attempts (max_retries=1); last: HTTP 503: warming up")
    rejected = RewardManager({"reward_functions": [_server_entry(f"{base}/rejects", max_retries=3)]}).score(_images(2), "x")
    assert state.calls["rejects"] == 1  # a 4xx other than 408 / 429 is the request's fault: never retried
    assert (
        rejected.reasons[0]
        == f"srv: RewardServerError: {base}/rejects answered HTTP 422: images must be at least 64 px (a client error: not retried)"
    )


@pytest.mark.parametrize("status", [408, 429])
def test_request_timeout_and_too_many_requests_answers_are_retried(scripted, status):
    """408 and 429 are the server asking to come back later: retried like a 5xx (one retry here, then the scores)."""
    state, base = scripted
    state.fail_first, state.fail_status, state.calls = 1, status, {}
    entry = _server_entry(f"{base}/flaky", max_retries=2, retry_backoff=0.05)
    ok = RewardManager({"reward_functions": [entry]}).score(_images(2), "x")
    assert not ok.failed.any(), ok.reasons
    assert ok.scores.tolist() == [0.25, 0.25] and state.calls["flaky"] == 2  # the 408 / 429, then the 200
    # Never more than max_retries + 1 attempts: with max_retries=1 a server that keeps answering it fails the batch.
    state.fail_first, state.calls = 5, {}
    gave_up = RewardManager({"reward_functions": [{**entry, "max_retries": 1}]}).score(_images(1), "x")
    assert state.calls["flaky"] == 2
    assert gave_up.reasons[0].endswith(f"no scores after 2 attempts (max_retries=1); last: HTTP {status}: warming up")


def test_a_bad_request_400_fails_at_once_without_a_retry(scripted):
    state, base = scripted
    state.fail_first, state.fail_status, state.calls = 1, 400, {}  # a second call would have been answered
    entry = _server_entry(f"{base}/flaky", max_retries=3, retry_backoff=0.05)
    result = RewardManager({"reward_functions": [entry]}).score(_images(2), "x")
    assert state.calls["flaky"] == 1 and result.failed.all()
    assert result.reasons[0].endswith("answered HTTP 400: warming up (a client error: not retried)")


def test_an_attempt_past_request_timeout_is_retried_and_the_next_answer_scores(scripted):
    """The first request hangs past request_timeout_s (the server answers it 1.5 s later, too late): the client gives
    that attempt up, waits retry_backoff, and the second attempt is answered."""
    state, base = scripted
    state.hang_s, state.calls = 1.5, {}
    entry = _server_entry(f"{base}/hang", request_timeout_s=0.3, max_retries=1, retry_backoff=0.05)
    start = time.monotonic()
    result = RewardManager({"reward_functions": [entry]}).score(_images(2), "x")
    elapsed = time.monotonic() - start
    assert not result.failed.any(), result.reasons
    # Two requests: a client that waited for the hung answer would have made one.
    assert result.scores.tolist() == [0.5, 0.5] and state.calls["hang"] == 2
    assert elapsed >= 0.3 + 0.05  # the timed-out attempt, then the backoff


def test_a_failed_batch_names_the_server_without_the_urls_credentials(scripted):
    """httpx sends a URL's `user:password@` as basic auth; the reason shows the URL without it and without the query."""
    state, base = scripted
    state.calls = {}
    host = base.removeprefix("http://")
    url = f"http://scorer:{SECRET}@{host}/rejects?token={SECRET}"
    result = RewardManager({"reward_functions": [_server_entry(url, max_retries=0)]}).score(_images(1), "x")
    assert state.calls["rejects"] == 1  # the request reached the server, credentials and all
    assert result.reasons[0] == (
        f"srv: RewardServerError: {base}/rejects answered HTTP 422: images must be at least 64 px (a client error: not retried)"
    )
    assert SECRET not in result.reasons[0]


def test_connection_refused_is_retried_then_fails_with_the_reason():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    entry = _server_entry(f"http://127.0.0.1:{port}/score", max_retries=2, retry_backoff=0.05)
    start = time.monotonic()
    result = RewardManager({"reward_functions": [entry]}).score(_images(2), "x")
    assert time.monotonic() - start >= 0.05 + 0.1
    assert result.failed.all()
    assert "no scores after 3 attempts (max_retries=2); last: ConnectError" in result.reasons[0]
    assert "Connection refused" in result.reasons[0]


def test_header_secrets_come_from_the_environment_and_never_reach_logs_errors_or_the_config(
    scripted, monkeypatch, caplog, tiny_sd3_dir
):
    state, base = scripted
    caplog.set_level(logging.DEBUG)
    entry = _server_entry(f"{base}/auth", headers={"Authorization": f"env:{TOKEN_VAR}"}, max_retries=0)
    manager = RewardManager({"reward_functions": [entry]})
    monkeypatch.delenv(TOKEN_VAR, raising=False)
    unset = manager.score(_images(1), "x")
    assert f"header 'Authorization' reads environment variable {TOKEN_VAR}, which is not set" in unset.reasons[0]

    monkeypatch.setenv(TOKEN_VAR, f"Bearer {SECRET}")
    ok = manager.score(_images(2), "x")
    assert not ok.failed.any() and state.seen["auth"][-1]["authorization"] == f"Bearer {SECRET}"  # it reached the server
    monkeypatch.setenv(TOKEN_VAR, f"Bearer {SECRET}-rotated")  # read per request: a rotated token is used at once
    wrong = manager.score(_images(1), "x")
    assert wrong.reasons[0].endswith("answered HTTP 401: bad token (a client error: not retried)")

    from omni_core.config import load_config, to_yaml

    cfg = load_config(
        overrides=[
            f"actor_rollout_ref.model.path={tiny_sd3_dir}",
            f"reward.reward_functions=[{{name: srv, server_url: '{base}/auth', headers: {{Authorization: 'env:{TOKEN_VAR}'}}}}]",
        ]
    )
    shipped = pickle.dumps(RewardManager(cfg.reward).terms[0].fn)  # what a process boundary would carry
    for text in (caplog.text, *unset.reasons, *wrong.reasons, to_yaml(cfg), repr(cfg), shipped.decode("latin-1")):
        assert SECRET not in text
    assert f"env:{TOKEN_VAR}" in to_yaml(cfg)


def test_verl_omni_http_scorer_entry_speaks_flow_grpo_pickle_and_refuses_pickled_globals(scripted):
    state, base = scripted
    verl_form = {
        "ocr": {
            "path": "pkg://verl_omni.utils.reward_score.http_scorer_client",
            "name": "compute_score",
            "weight": 1.0,
            "server_url": f"{base}/flow_grpo",
            "max_retries": 2,
            "retry_backoff": 0.5,
        }
    }
    images = _images(3, seed=4)
    truths = ["OMNI", "FLOW", "GRPO"]
    result = RewardManager({"reward_functions": verl_form}).score(images, "ocr", ground_truths=truths, prompts=["a", "b", "c"])
    assert not result.failed.any()
    for img, score in zip(images, result.scores, strict=True):  # the server saw PIL's default-quality JPEG
        buffer = io.BytesIO()
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(buffer, format="JPEG")
        expected = np.asarray(Image.open(io.BytesIO(buffer.getvalue()))).mean() / 255
        assert score.item() == pytest.approx(expected, rel=1e-6)
    payload = state.seen["pickle"][-1]
    assert payload["prompts"] == truths and payload["metadata"] == {}  # as verl-omni's client sends them
    evil = RewardManager({"reward_functions": verl_form}).score(images[:1], "ocr", ground_truths=["evil"])
    assert evil.failed.all() and "needs the global posix.getpid" in evil.reasons[0]  # refused, never called


def test_a_training_run_scores_through_a_served_reward_and_its_token_stays_out_of_every_record(
    served, scripted, prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path
):
    """One lean epoch whose only reward is a server term behind a bearer token (`headers: {Authorization:
    env:RUN_TOKEN_VAR}`): every request carried the token; the rewards the run recorded are the ones the server
    computed (its reward file logs each score); and the token is in none of the run's records: its Prefect logs
    (read through the API), its checkpoint folder (the saved config.yaml, metrics.jsonl, the mlflow store, the
    weights) and its mlflow params."""
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    server, _, log = served
    state_, base = scripted
    state_.upstream, state_.seen["token_proxy"] = server.url, []
    before = len(log.read_text().splitlines()) if log.exists() else 0
    ckpt = tmp_path / "ckpt"
    entry = f"{{name: served, server_url: '{base}/token_proxy', headers: {{Authorization: 'env:{RUN_TOKEN_VAR}'}}"
    overrides = [
        *flow_overrides,
        "trainer.total_epochs=1",
        "trainer.val_before_train=false",
        "trainer.logger=[console,file,mlflow]",
        f"trainer.default_local_dir={ckpt}",
        f"reward.reward_functions=[{entry}, batch_size: 4, max_concurrency: 2}}]",
    ]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    # 2 prompts x 4 samples in batches of 4: two requests, each with the token read in the rollout worker.
    assert state_.seen["token_proxy"] == [True, True]
    # The run's images are 32 px; a call of an earlier test that timed out on the client may still log (24 px).
    rows = [json.loads(line) for line in log.read_text().splitlines()[before:]]
    served_scores = [row["score"] for row in rows if row["height"] == 32]
    assert len(served_scores) == 8  # 2 prompts x 4 samples, scored by the server
    metrics = [json.loads(line) for line in next(ckpt.rglob("metrics.jsonl")).read_text().splitlines()]
    step = next(m for m in metrics if "critic/rewards/mean" in m)
    assert step["critic/rewards/mean"] == pytest.approx(float(np.mean(served_scores)), abs=1e-6)
    assert step["critic/rewards/max"] == pytest.approx(max(served_scores), abs=1e-6)
    assert step["critic/rewards/min"] == pytest.approx(min(served_scores), abs=1e-6)

    # The Prefect logs of the run and its subflows, once the last epoch's line is in (a Ray worker's task sends its
    # lines in batches, a moment after the run may have ended).
    messages = run_log_messages(state.state_details.flow_run_id, until="checkpoint saved")
    assert any("checkpoint saved" in m for m in messages), messages[-20:]
    assert [m for m in messages if RUN_SECRET in m] == []
    # Every file of the checkpoint folder, as bytes: config.yaml names the variable, never its value.
    saved = (ckpt / "global_step_1" / "config.yaml").read_text()
    assert f"env:{RUN_TOKEN_VAR}" in saved
    files = [f for f in ckpt.rglob("*") if f.is_file()]
    assert {"config.yaml", "metrics.jsonl", "mlflow.db", "model.safetensors"} <= {f.name for f in files}
    assert [f for f in files if RUN_SECRET.encode() in f.read_bytes()] == []
    # mlflow's params (the resolved config), read back through mlflow: the headers are there, as the reference.
    params = _mlflow_params(ckpt)
    assert any(f"env:{RUN_TOKEN_VAR}" in value for value in params.values()), params
    assert [key for key, value in params.items() if RUN_SECRET in value] == []


def _mlflow_params(ckpt: Path) -> dict[str, str]:
    """The params of the one mlflow run in the checkpoint folder's store."""
    from mlflow.tracking import MlflowClient

    from omni_core.trackers.mlflow_run import mlflow_tracking_uri

    client = MlflowClient(tracking_uri=mlflow_tracking_uri(ckpt))
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(experiments)
    return run.data.params


def test_the_reward_server_command_refuses_other_keys_and_bad_entries_before_serving(capsys):
    from omniflow.flows.cli import main

    assert main(["reward-server", "--port", "0", "data.train_batch_size=4"]) == 2
    assert "data.train_batch_size: a reward server reads only reward.* keys and trainer.device" in capsys.readouterr().err
    assert main(["reward-server", "--port", "0", "reward.reward_functions=[{name: pickscore}]"]) == 2
    assert "reward.reward_functions[0].model_path=null: pickscore needs model_path" in capsys.readouterr().err
