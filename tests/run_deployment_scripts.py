"""Scripts of the run_deployment tests: a parent flow that imports only prefect (the example of docs/deployments.md),
and a reader of a run's result in a process where OmniFlow cannot be imported."""

from __future__ import annotations

import json
import subprocess
import textwrap

# The parent: prefect only. It prints which OmniFlow modules it had imported before reading the result (none),
# then the result's type and fields as JSON.
PARENT = textwrap.dedent(
    """
    import json, sys
    from prefect import flow
    from prefect.deployments import run_deployment

    @flow(name="nightly-ml-pipeline")
    def parent(parameters: dict, timeout: float) -> None:
        run = run_deployment(name="main_diffusion_v1/tiny-sd3-on-demand", parameters=parameters, timeout=timeout)
        if not run.state.is_completed():
            raise RuntimeError(f"fine-tune {run.name}: {run.state.message}")
        before = sorted(m for m in sys.modules if m.split(".")[0] in ("omniflow", "omni_core"))
        result = run.state.result()
        print("RESULT=" + json.dumps({
            "flow_run_id": str(run.id),
            "parent_task_run_id": str(run.parent_task_run_id),
            "omniflow_modules_before_result": before,
            "type": type(result).__name__,
            "result": result.model_dump(mode="json"),
        }), flush=True)

    parent(parameters=json.loads(sys.argv[1]), timeout=float(sys.argv[2]))
    """
)

# A process where OmniFlow is not importable reads the same run's result: Prefect's JSON decoder then returns the
# stored {"__class__": ..., "data": {...}} as it is.
READER_WITHOUT_OMNIFLOW = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class NoOmniFlow(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("omniflow", "omni_core"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoOmniFlow())
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        result = client.read_flow_run(sys.argv[1]).state.result()
    print("RESULT=" + json.dumps(result), flush=True)
    """
)


def result_line(out: subprocess.CompletedProcess) -> dict:
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT=")]
    assert out.returncode == 0 and lines, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESULT="))
