"""Library use: `main_diffusion_v1(...)` called from plain Python, in a fresh process with no Prefect setting at all,
runs against the embedded local Prefect API (started for the call, stopped after it), never Prefect's ephemeral mode.

The run is a cheap real one: its config breaks a cross-field rule, so it fails in its first task (validate_config),
with the flow run and its task run recorded by the embedded server.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = """
import os, sys
from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

state = main_diffusion_v1(overrides=sys.argv[1:], return_state=True)
from prefect.server.api.server import SubprocessASGIServer

print("STATE", state.type.value, " ".join(state.message.split()))
print("EPHEMERAL_SERVERS", len(SubprocessASGIServer._instances))
print("API_URL_AFTER", os.environ.get("PREFECT_API_URL"))
"""


def test_flow_called_from_python_without_an_api_uses_the_embedded_one(tmp_path, flow_overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # a user's shell: nothing of Prefect
    bad = [
        *(o for o in flow_overrides if o.startswith(("actor_rollout_ref.model", "data.train_files", "data.val_files"))),
        "data.train_batch_size=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *bad], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "main_diffusion_v1: no PREFECT_API_URL set: started the embedded Prefect API http://127.0.0.1:" in proc.stderr, out[
        -3000:
    ]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("STATE", "EPHEMERAL", "API_URL")))
    assert lines["STATE"].startswith("FAILED") and "data.train_batch_size=3" in lines["STATE"], lines
    assert lines["EPHEMERAL_SERVERS"] == "0"  # Prefect never started its temporary server in this process
    assert lines["API_URL_AFTER"] == "None"  # the caller's environment is as it was
    # The run is in the embedded server's database (PREFECT_HOME defaults to ./outputs/prefect, as for `omniflow train`).
    db = Path(tmp_path) / "outputs" / "prefect" / "prefect.db"
    with sqlite3.connect(db) as con:
        runs = con.execute(
            "select state_type from flow_run where flow_id in (select id from flow where name = ?)", ("main_diffusion_v1",)
        ).fetchall()
        tasks = con.execute("select name, state_type from task_run").fetchall()
    assert runs == [("FAILED",)]
    assert [(name.rsplit("-", 1)[0], state) for name, state in tasks] == [("validate_config", "FAILED")]


def test_the_guard_leaves_processes_with_an_api_alone():
    """With PREFECT_API_URL set (a served or deployed run, a user's server), a flow call needs no embedded server."""
    from omniflow.flows.library_use import needs_embedded_api
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert not needs_embedded_api()
    with temporary_settings(updates={PREFECT_API_URL: ""}):
        assert needs_embedded_api()
