"""The `mlflow` backend: one mlflow run per checkpoint folder, with the resolved config as params, every step's
metrics, the validation images and, at the end of training, the final model as the artifact folder `model/`.

Where: `MLFLOW_TRACKING_URI` when it is set (a server, a database; as verl reads it), else a local store in the
checkpoint folder, `sqlite:///<checkpoint dir>/mlruns/mlflow.db` with artifacts in `<checkpoint dir>/mlruns/artifacts`:
next to the checkpoints it describes, found again by a resume of that folder, and gone with it. A database file
rather than mlflow's old `./mlruns` folder store, which mlflow 3 keeps in maintenance mode and refuses unless
MLFLOW_ALLOW_FILE_STORE=true; `mlflow ui --backend-store-uri sqlite:///<checkpoint dir>/mlruns/mlflow.db` shows it.

Same run across epochs, retries and resumes: mlflow stores make their own run ids, so the run carries
`TrackerRun.run_id` as the tag `omniflow.run_id` and each epoch looks it up. mlflow keeps a run's history
append-only and its params fixed: a retried or resumed epoch does not log a metric again at a step the run already
has for it, nor the images of a step it already has (the failed try's values stay; on CPU they are bit-identical),
and a param whose value changed on resume keeps its first value (the change is reported on the console).
Uses `MlflowClient` on an explicit run id (never mlflow's process-global active run), so nothing leaks between runs.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omni_core.config.defaults_file import flatten
from omni_core.trackers.run import TrackerRun

STORE_DIR = "mlruns"
RUN_ID_TAG = "omniflow.run_id"
MODEL_ARTIFACT = "model"
IMAGES_ARTIFACT = "val_generations"  # one `step_<N>.json` per validation: the image keys and their captions
MODEL_STEP_TAG = "omniflow.model_step"
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")  # mlflow's metric / param names: letters, digits, _ - . space : /


def mlflow_tracking_uri(checkpoint_dir: str | Path | None) -> str:
    """`MLFLOW_TRACKING_URI`, else the SQLite store `<checkpoint_dir>/mlruns/mlflow.db` (see the module docstring)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if checkpoint_dir is None:
        raise ValueError("the mlflow backend needs the run's checkpoint folder (its local store) or MLFLOW_TRACKING_URI")
    return f"sqlite:///{Path(checkpoint_dir).resolve() / STORE_DIR / 'mlflow.db'}"


def metric_name(key: str) -> str:
    """A metric key mlflow accepts: `@` as `_at_` (as verl writes `val-core/.../mean@4`), other odd characters `_`."""
    return _BAD_NAME_CHARS.sub("_", key.replace("@", "_at_"))


def _param_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class MlflowTracker:
    """One epoch's handle on the training run's mlflow run (created on the first epoch, found by its tag after)."""

    def __init__(self, run: TrackerRun):
        from mlflow.tracking import MlflowClient

        from omni_core.quiet import drop_library_notices

        drop_library_notices()  # the store's schema-migration INFO lines
        self.tracking_uri = mlflow_tracking_uri(run.checkpoint_dir)
        # The default store: the database and, set on the experiment it creates, the artifact folder, side by side.
        store = None if os.environ.get("MLFLOW_TRACKING_URI") else Path(str(run.checkpoint_dir)).resolve() / STORE_DIR
        if store is not None:
            store.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._experiment(run.project, (store / "artifacts").as_uri() if store is not None else None)
        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run.run_id}'", max_results=1
        )
        self.notes: list[str] = []  # lines for the console (changed params on resume)
        # (metric key -> last step the run has it at) and the steps that have images: a retried or resumed epoch
        # skips what the run already holds (mlflow's history is append-only).
        self._last_step: dict[str, int] = {}
        self._image_steps: set[int] = set()
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self._read_history(found[0].data.metrics)
            self._log_params(run.config, dict(found[0].data.params))
        else:
            self.run_id = self.client.create_run(self.experiment_id, run_name=run.name, tags={RUN_ID_TAG: run.run_id}).info.run_id
            self._log_params(run.config, {})

    @property
    def where(self) -> str:
        return f"mlflow run {self.run_id} in {self.tracking_uri}"

    def _experiment(self, name: str, artifact_location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:  # created meanwhile by another run of the same store
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _read_history(self, latest: Mapping[str, float]) -> None:
        for key in latest:
            history = self.client.get_metric_history(self.run_id, key)
            if history:
                self._last_step[key] = max(m.step for m in history)
        for item in self.client.list_artifacts(self.run_id, IMAGES_ARTIFACT):
            match = re.fullmatch(rf"{IMAGES_ARTIFACT}/step_(\d+)\.json", item.path)
            if match:
                self._image_steps.add(int(match.group(1)))

    def _log_params(self, config: Mapping[str, Any], existing: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {metric_name(k): _param_value(v)[:MAX_PARAM_VAL_LENGTH] for k, v in flatten(dict(config)).items()}
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            shown = ", ".join(f"{k} ({existing[k]} -> {params[k]})" for k in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            self.notes.append(f"mlflow run {self.run_id} keeps the first value of changed params: {shown}{more}")
        new = [Param(k, v) for k, v in params.items() if k not in existing]
        for chunk in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        rows = []
        for key, value in metrics.items():
            name = metric_name(key)
            if step > self._last_step.get(name, -1):
                rows.append(Metric(name, float(value), now, step))
        for chunk in _chunks(rows, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_images(self, step: int, images: torch.Tensor, captions: Sequence[str]) -> str:
        """uint8 `[N, 3, H, W]` as mlflow images `val/generations/<i>` at `step` (the UI's image grid with its step
        slider) and `val_generations/step_<step>.json` with their captions; says where they went."""
        where = f"mlflow run {self.run_id} (val/generations)"
        if step in self._image_steps:
            return where
        entries = []
        for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
            key = f"val/generations/{i}"
            self.client.log_image(self.run_id, image.permute(1, 2, 0).numpy(), key=key, step=step)
            entries.append({"key": key, "caption": caption})
        self.client.log_dict(self.run_id, {"step": step, "images": entries}, f"{IMAGES_ARTIFACT}/step_{step}.json")
        self._image_steps.add(step)
        return where

    def log_model(self, model_dir: Path, step: int) -> str:
        """The folder `model_dir` as the artifact folder `model/` (files of an earlier one overwritten), tagged with its step."""
        self.client.log_artifacts(self.run_id, str(model_dir), MODEL_ARTIFACT)
        self.client.set_tag(self.run_id, MODEL_STEP_TAG, str(step))
        return f"mlflow run {self.run_id} artifact {MODEL_ARTIFACT}/"

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def registered_model_name(project: str, experiment: str) -> str:
    """The registry name of a run's exports: `<trainer.project_name>.<trainer.experiment_name>` (mlflow refuses `/`
    and `:` in a registered model's name; they become `-`)."""
    return re.sub(r"[/:]", "-", f"{project}.{experiment}")


def register_export(
    checkpoint_dir: Path, project: str, experiment: str, run_dir: Path, export_dir: Path, step: int | None, kind: str
) -> str:
    """A new version of the registered model `registered_model_name(project, experiment)` (created on first use) whose
    source is the export folder `export_dir`, in the store the run's `mlflow` tracker used (`mlflow_tracking_uri`
    of `checkpoint_dir`, the folder of the run's checkpoints), linked to the tracker run when the store has it
    (found by its `omniflow.run_id` tag, from the config's checkpoint folder `run_dir`). Returns `<name>/<version>`.

    Works on mlflow-skinny's SQLite store (the registry tables live in the same database as the runs).
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from omni_core.quiet import drop_library_notices
    from omni_core.trackers.run import tracker_run_id

    drop_library_notices()
    uri = mlflow_tracking_uri(checkpoint_dir)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name = registered_model_name(project, experiment)
    try:
        client.create_registered_model(name, description=f"OmniFlow exports of the experiment {experiment}")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    run_id = None
    experiment_found = client.get_experiment_by_name(project)
    if experiment_found is not None:
        tag = tracker_run_id(project, experiment, run_dir)
        runs = client.search_runs([experiment_found.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{tag}'", max_results=1)
        run_id = runs[0].info.run_id if runs else None
    version = client.create_model_version(
        name,
        source=export_dir.resolve().as_uri(),
        run_id=run_id,
        tags={MODEL_STEP_TAG: str(step), "omniflow.export_kind": kind},
        description=f"{kind} export of step {step} in {export_dir}",
    )
    return f"{name}/{version.version}"
