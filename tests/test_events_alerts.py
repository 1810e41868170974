"""Events and alerts against a real `prefect server start` (127.0.0.1, its own PREFECT_HOME; the triggers and
actions services on, as by default): `ensure_automations` creates the `omniflow-alerts` Webhook block and the two
automations, idempotently; a `main_diffusion_v1` run that fails (a cross-field config error, after the flow
started) and an `omniflow.reward.regressed` event each make the server call a webhook on a local HTTP listener.
Plus the regression rule on a hand-made sequence of validation rewards."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from real_prefect import REPO, api, server_env

pytestmark = pytest.mark.timeout(300)

# The server's trigger service reads events from its broker as they arrive; measured here ~1-3 s from the event to
# the webhook call on 2 busy cores. The deadline only bounds the wait.
WEBHOOK_DEADLINE_S = 60


class Listener:
    """An HTTP listener on 127.0.0.1 that records the JSON body of every POST."""

    def __init__(self) -> None:
        bodies: list[Any] = []
        self.bodies = bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                bodies.append(json.loads(raw) if raw else None)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, alert: str, timeout_s: float = WEBHOOK_DEADLINE_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [b for b in self.bodies if isinstance(b, dict) and b.get("alert") == alert]
            if found:
                return found[0]
            time.sleep(0.3)
        raise AssertionError(f"no {alert} webhook after {timeout_s:.0f}s; received: {self.bodies}")


@pytest.fixture(scope="module")
def alerts_server(tmp_path_factory):
    from omniflow.flows.embedded_api import PrefectServer

    root = tmp_path_factory.mktemp("alerts")
    server = PrefectServer(root / "home").start()
    listener = Listener()
    try:
        server.wait_ready()
        yield server, listener, root
    finally:
        listener.server.shutdown()
        server.stop()


def _in_server(url: str, home, code: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    """Python `code` in a fresh process that talks to the server at `url` (Prefect reads its settings at import)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=server_env(url, home),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_the_regression_rule_on_a_hand_made_sequence():
    from omniflow.flows.events import Regression, RewardWatch

    watch = RewardWatch(drop=0.5)
    # best 1.0 at step 2; 0.6 is 0.4 below it (not more than 0.5); 0.4 is 0.6 below: a regression, reported once;
    # 0.3 stays down (no second alert); 1.2 is a new best, after which 0.6 (0.6 below it) is reported again.
    seen = [watch.observe(step, r) for step, r in [(0, 0.2), (2, 1.0), (4, 0.6), (6, 0.4), (8, 0.3), (10, 1.2), (12, 0.6)]]
    assert seen == [None, None, None, Regression(6, 0.4, 1.0, 2, 0.5), None, None, Regression(12, 0.6, 1.2, 10, 0.5)]
    assert (watch.best, watch.best_step) == (1.2, 10)
    disabled = RewardWatch(drop=None)
    assert [disabled.observe(s, r) for s, r in [(0, 1.0), (1, -5.0)]] == [None, None]
    assert disabled.best == 1.0  # kept either way


def test_the_key_is_refused_when_the_run_never_validates_twice():
    from omni_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"reward_regression_drop=0.1 .* trainer.test_freq=-1 .* set trainer.test_freq=N"):
        load_config([], ["trainer.alerts.reward_regression_drop=0.1"])
    assert (
        load_config(
            [], ["trainer.alerts.reward_regression_drop=0.1", "trainer.test_freq=2"]
        ).trainer.alerts.reward_regression_drop
        == 0.1
    )


def test_ensure_automations_without_a_block_or_url_creates_nothing_then_is_idempotent(alerts_server):
    from omniflow.deployments.automations import BLOCK_NAME, REWARD_REGRESSED, RUN_FAILED

    server, listener, _ = alerts_server
    code = """
        import json
        from omniflow.deployments.automations import ensure_automations
        print(json.dumps([ensure_automations(), ensure_automations({url!r}), ensure_automations()]))
    """
    done = _in_server(server.url, server.home, code.replace("{url!r}", repr(listener.url)))
    assert done.returncode == 0, done.stderr[-3000:]
    nothing, first, again = json.loads(done.stdout.strip().splitlines()[-1])
    assert nothing == [] and first == again == [RUN_FAILED, REWARD_REGRESSED]
    with api(server.url) as client:
        for name in (RUN_FAILED, REWARD_REGRESSED):
            (automation,) = client.read_automations_by_name(name)  # updated by name, never duplicated
            assert automation.enabled and automation.actions[0].type == "call-webhook"
        (block,) = [d for d in client.read_block_documents() if d.name == BLOCK_NAME]
        assert block.block_type.slug == "webhook" and block.data["url"] == listener.url


def test_a_failing_run_and_a_regression_event_call_the_webhook(alerts_server, tiny_sd3_dir):
    server, listener, root = alerts_server
    code = """
        from omniflow.deployments.automations import ensure_automations
        ensure_automations({url!r})
    """
    done = _in_server(server.url, server.home, code.replace("{url!r}", repr(listener.url)))
    assert done.returncode == 0, done.stderr[-3000:]
    # A cross-field error (7 prompts per batch, mini-batches of 2) fails validate_config inside the flow run.
    failing = f"""
        from omniflow.flows.main_diffusion_v1 import main_diffusion_v1
        state = main_diffusion_v1(
            overrides=["actor_rollout_ref.model.path={tiny_sd3_dir}", "data.train_batch_size=7",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.default_local_dir={root / "ckpt"}"],
            return_state=True,
        )
        print("FLOW_RUN", state.state_details.flow_run_id, state.type.value)
    """
    run = _in_server(server.url, server.home, failing)
    line = [x for x in run.stdout.splitlines() if x.startswith("FLOW_RUN")]
    assert line, run.stdout[-2000:] + run.stderr[-3000:]
    _, flow_run_id, state = line[0].split()
    assert state == "FAILED"
    body = listener.wait_for("omniflow-run-failed")
    assert body["flow_run_id"] == flow_run_id and body["state"] == "Failed"
    assert "data.train_batch_size=7" in body["message"], body

    # The regression event as the fit subflow emits it (flows/events.py), from a process pointed at the server.
    emit = """
        from prefect.events import emit_event
        from prefect.events.worker import EventsWorker
        emit_event("omniflow.reward.regressed",
                   resource={"prefect.resource.id": "omniflow.experiment.p.exp", "prefect.resource.name": "exp",
                             "omniflow.run-id": "exp-1234abcd"},
                   payload={"step": 6, "reward": 0.4, "best": 1.0, "best_step": 2, "drop": 0.5})
        EventsWorker.drain_all(timeout=30)
    """
    sent = _in_server(server.url, server.home, emit)
    assert sent.returncode == 0, sent.stderr[-3000:]
    body = listener.wait_for("omniflow-reward-regressed")
    assert body == {**body, "experiment": "exp", "run_id": "exp-1234abcd", "step": 6, "reward": 0.4, "best": 1.0, "drop": 0.5}

    # The run's own omniflow.run.failed event (its on_failure hook) reached the server too.
    from prefect.events.filters import EventFilter, EventNameFilter

    deadline, events = time.monotonic() + WEBHOOK_DEADLINE_S, []
    while not events and time.monotonic() < deadline:  # the server persists events in batches
        with api(server.url) as client:
            response = client.request(
                "POST",
                "/events/filter",
                json={"filter": EventFilter(event=EventNameFilter(name=["omniflow.run.failed"])).model_dump(mode="json")},
            )
        events = response.json()["events"]
        time.sleep(0.5)
    assert [e["resource"]["prefect.resource.id"] for e in events] == [f"omniflow.flow-run.{flow_run_id}"], run.stderr[-3000:]
    assert events[0]["payload"]["state"] == "Failed"
