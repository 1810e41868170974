"""A local Ray start that times out (`ray_cluster.RayStartTimeoutError`), in a process of its own.

Ray 2.60 waits a fixed 30 s for the node it starts to register with its GCS; on a host whose cores are all busy it
gave up once in the suite ("The current node timed out during startup"), a bare Exception that failed the run. Here
the raylet is really stopped (SIGSTOP, as a starved process is never scheduled) the moment it appears: the start
fails with `RayStartTimeoutError`, which the `init_ray` task retries (`faults.is_retryable`), every process the
failed start left is gone, and a second start in the same process (the retry) brings a cluster up.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)

_SCRIPT = r"""
import threading, time
import psutil, ray
from omni_core.config import load_config
from omni_core.distributed.ray_cluster import RayStartTimeoutError, connect_ray
from omni_core.faults import is_retryable

cfg = load_config(overrides=["ray_kwargs.ray_init.num_cpus=2"])
me, stopped = psutil.Process(), []

def stop_the_raylet():
    deadline = time.monotonic() + 120
    while not stopped and time.monotonic() < deadline:
        for p in me.children(recursive=True):
            try:
                if p.name() == "raylet":
                    p.suspend()
                    stopped.append(p)
                    break
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.01)

threading.Thread(target=stop_the_raylet, daemon=True).start()
try:
    connect_ray(cfg)
    print("started", flush=True)
except RayStartTimeoutError as exc:
    print("timed out; retryable:", is_retryable(exc), flush=True)
    print("message:", exc, flush=True)
    print("raylet stopped:", len(stopped), "gone:", not stopped[0].is_running(), flush=True)
    print("left:", sorted(p.name() for p in me.children(recursive=True)), flush=True)
print("retry started a cluster:", connect_ray(cfg), ray.is_initialized(), int(ray.cluster_resources()["CPU"]), flush=True)
ray.shutdown()
print("left after shutdown:", sorted(p.name() for p in me.children(recursive=True) if p.status() != "zombie"), flush=True)
"""


def test_a_start_whose_raylet_never_registers_is_stopped_and_retried(tmp_path):
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=200, cwd=tmp_path)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "timed out; retryable: True" in lines, out.stdout
    message = next(line for line in lines if line.startswith("message:"))
    assert "timed out during startup" in message and "the start is retried" in message, message
    assert "raylet stopped: 1 gone: True" in lines, out.stdout
    assert "left: []" in lines, out.stdout  # no GCS server, raylet, dashboard, log monitor or reaper behind
    assert "retry started a cluster: True True 2" in lines, out.stdout
