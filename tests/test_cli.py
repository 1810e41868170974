"""The `omniflow` command: config show / schema / validate, fast and without Ray or Prefect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import yaml

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omniflow.flows.cli", *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=120
    )


def test_config_show_prints_the_merged_config(tmp_path):
    out = _run("config", "show", "trainer.total_epochs=3", "actor_rollout_ref.rollout.n=4", cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["trainer"]["total_epochs"] == 3
    assert shown["actor_rollout_ref"]["rollout"]["n"] == 4
    assert shown["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-3  # defaults fill the rest


def test_config_show_reads_a_file_then_overrides(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("trainer:\n  total_epochs: 9\n  project_name: from_file\n")
    out = _run("config", "show", str(f), "trainer.total_epochs=4")
    shown = yaml.safe_load(out.stdout)
    assert (shown["trainer"]["total_epochs"], shown["trainer"]["project_name"]) == (4, "from_file")


def test_config_schema_is_json_with_descriptions():
    out = _run("config", "schema")
    schema = json.loads(out.stdout)
    assert "DataConfig" in schema["$defs"]
    assert schema["$defs"]["TrainerConfig"]["properties"]["use_v1"]["description"].startswith("Use the v1")


def test_validate_ok_on_the_default_config(tiny_sd3_dir):
    out = _run("validate", f"actor_rollout_ref.model.path={tiny_sd3_dir}")
    assert out.returncode == 0, out.stderr
    assert "config OK" in out.stdout


def _descendants_while_running(proc: subprocess.Popen) -> tuple[set[str], float]:
    """Command lines of every process the CLI spawned while it ran (polled), and its wall time."""
    seen: set[str] = set()
    start = time.monotonic()
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            for child in parent.children(recursive=True):
                seen.add(" ".join(child.cmdline()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    return seen, time.monotonic() - start


def test_validate_rejects_a_bad_config_promptly_without_ray_or_prefect():
    code = (
        "import sys; from omniflow.flows.cli import main; rc = main(sys.argv[1:]); "
        "heavy = [m for m in ('ray', 'prefect', 'transfer_queue', 'diffusers') if m in sys.modules]; "
        "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "validate", "data.train_batch_size=7", "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    spawned, wall = _descendants_while_running(proc)
    _, err = proc.communicate()
    assert proc.returncode == 2
    assert "data.train_batch_size=7" in err and "actor_rollout_ref.actor.ppo_mini_batch_size=2" in err
    assert "HEAVY []" in err  # neither Ray nor Prefect was even imported
    assert not [c for c in spawned if any(s in c for s in ("raylet", "gcs_server", "prefect", "uvicorn"))]
    assert wall < 30


def test_omniflow_flows_imports_from_any_folder(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", "import omniflow.flows, omni_core, sys; print(omniflow.flows.__name__, 'prefect' in sys.modules)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ENV,
    )
    assert out.stdout.split() == ["omniflow.flows", "False"], out.stderr


def test_omni_core_does_not_import_prefect(tmp_path):
    code = "import omni_core, omni_core.config, omni_core.validation, omni_core.trainers, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'prefect_ray', 'omniflow')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=ENV)
    assert out.stdout.strip() == "[]", out.stderr
