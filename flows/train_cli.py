"""`omniflow train`: run `main_diffusion_v1` from the command line, verl style.

Order matters: the config is checked first (seconds, nothing started), then the embedded Prefect API
starts (unless `PREFECT_API_URL` is set), then the flow runs. Ctrl-C or SIGTERM end the run cleanly:
the flow's `finally` closes the TransferQueue and the actors, the Ray cluster this run started is
shut down, the Prefect server is stopped, and the last checkpoint stays as it was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence

QUIET_ENV = {
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAY_DEDUP_LOGS": "0",
    "TQ_LOGGING_LEVEL": "ERROR",
}


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_training(args: Sequence[str]) -> int:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    from omniflow.flows.cli import _split_files_and_overrides
    from omniflow.flows.embedded_api import embedded_prefect_api

    from omni_core.config import ConfigError, load_config
    from omni_core.device import auto_set_device
    from omni_core.validation import validate_config

    files, overrides = _split_files_and_overrides(args)
    try:
        config = auto_set_device(load_config(files, overrides))
        validate_config(config)
    except ConfigError as exc:
        print(f"omniflow: {exc}", file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    with embedded_prefect_api() as api:
        from omniflow.flows.main_diffusion_v1 import main_diffusion_v1  # imports while the server boots

        api.wait_ready()
        ui = api.ui_url
        print(f"omniflow: Prefect API {api.url} (PREFECT_HOME={os.environ.get('PREFECT_HOME')})", flush=True)
        if ui:
            print(f"omniflow: watch the run at {ui}/runs", flush=True)

        from prefect.exceptions import TerminationSignal
        from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

        # Prefect reads its settings when first imported (`python -m omniflow.flows.main_diffusion_v1`
        # imports it before this runs), so the run's API is set on the settings context as well; Ray
        # workers receive this context with every task.
        updates = {PREFECT_API_URL: api.url, PREFECT_HOME: os.environ["PREFECT_HOME"]} if api.proc else {}
        try:
            with temporary_settings(updates=updates):
                state = main_diffusion_v1(config=None, overrides=list(overrides), config_files=list(files), return_state=True)
        except (KeyboardInterrupt, SystemExit, TerminationSignal):
            # Ctrl-C, or SIGTERM (which Prefect's engine turns into a crash + SystemExit): the flow's
            # finally has closed the TransferQueue and the actors; Ray and the server stop below.
            print("omniflow: interrupted; the last checkpoint is intact and the run's processes are stopped", file=sys.stderr)
            return 130
        finally:
            _shutdown_ray()
        flow_run_id = state.state_details.flow_run_id
        if ui:
            print(f"omniflow: flow run {ui}/runs/flow-run/{flow_run_id}", flush=True)
        if not state.is_completed():
            print(f"omniflow: run {state.name}: {state.message}", file=sys.stderr)
            return 1
        with temporary_settings(updates=updates):
            result = state.result()
        _report(result, config)
    return 0


def _shutdown_ray() -> None:
    with contextlib.suppress(Exception):
        import ray

        if ray.is_initialized():
            ray.shutdown()


def _report(result, config) -> None:
    print("omniflow: run finished", flush=True)
    if result.final_metrics == {} and result.global_step > 0:
        print(
            f"  nothing to train: resumed at step {result.global_step}, the end of this experiment; start a new one "
            f"with trainer.experiment_name=<name> or trainer.resume_mode=disable"
        )
    print(f"  run id:           {result.run_id}")
    print(f"  steps trained:    {result.global_step}")
    print(f"  checkpoints:      {result.checkpoint_dir} (last: {result.final_checkpoint})")
    print(f"  metrics:          {result.log_dir}")
    print(
        "  artifacts:        omniflow-run-summary (reward curve), omniflow-validation (image grids), "
        "omniflow-reward-curve, omniflow-epoch-metrics, omniflow-checkpoint, omniflow-progress (Prefect UI)"
    )
    print(f"  mean reward, first steps: {result.reward_first:.6f}")
    print(
        f"  mean reward, last steps:  {result.reward_last:.6f}  ({'higher' if result.reward_last > result.reward_first else 'not higher'})"
    )
    if result.val_metrics:
        print(f"  validation:       {result.val_metrics}")
    home = os.environ.get("PREFECT_HOME")
    if home:
        print(f"  browse past runs: PREFECT_HOME={home} prefect server start  (then open http://127.0.0.1:4200)")
