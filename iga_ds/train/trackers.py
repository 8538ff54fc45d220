"""Weights & Biases and MLflow, for ``logging.report_to``: what rank 0 sends them and when.

Each tracker gets the scalars of every metrics.jsonl line (same names, same steps) and, once, the
resolved config (config.resolved.yaml) flattened into short params. The clients are optional
(``pip install 'iga-ds[tracking]'``): :func:`require_trackers` names the missing one before a
step runs. Credentials stay the clients' business: wandb reads ``WANDB_API_KEY`` from the
environment (or its netrc) itself; nothing here reads, passes or logs one.

A tracker's run id is kept in ``output_dir/tracking.json``, so a run resumed from a checkpoint
continues the same W&B and MLflow run (W&B ignores steps at or below the last it has, i.e. the
steps a killed run logged after its last checkpoint; MLflow keeps both values of such a step).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from iga_ds.config.run import RUN_CONFIG, LoggingConfig
from iga_ds.errors import ConfigError, UserError
from iga_ds.files import atomic_write_json, read_yaml_file

log = logging.getLogger("iga_ds.train")

TRACKING_FILE = "tracking.json"  # the trackers' run ids, for a resume
# tracker -> (its module, what to install for it)
CLIENTS = {"wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow-skinny")}
PARAM_CHARS = 250  # a param's value is cut to this (MLflow's limit was 500 before 2.x)
# resolved keys not sent as params: long, and in config.resolved.yaml beside the run
SKIPPED_PARAMS = ("resolved.deepspeed_config",)


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it fail (how tests hide a client)
    return importlib.util.find_spec(module) is not None


def require_trackers(settings: LoggingConfig) -> None:
    """Every rank, before the first step: each client ``report_to`` names is installed."""
    for name in settings.report_to:
        if name in CLIENTS and not _installed(CLIENTS[name][0]):
            raise ConfigError(f"logging.report_to: {name} is not installed: {CLIENTS[name][1]} "
                              f"(or pip install 'iga-ds[tracking]')")


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"lora": {"r": 4, "target_modules": ["q_proj"]}}`` -> ``{"lora.r": 4, "lora.target_modules":
    '["q_proj"]'}``: numbers, booleans and null kept, lists as JSON, text cut to PARAM_CHARS."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if name in SKIPPED_PARAMS:
            continue
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, name + "."))
            continue
        if value is None or isinstance(value, (bool, int, float)):
            flat[name] = value
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        flat[name] = text if len(text) <= PARAM_CHARS else text[:PARAM_CHARS - 3] + "..."
    return flat


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl line, its step aside (what TensorBoard gets too)."""
    return {key: value for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class WandbRun:
    def __init__(self, out: Path, settings: LoggingConfig, params: dict[str, Any], run_id: str | None, quiet: bool):
        import wandb  # optional: the tracking extra

        self.run = wandb.init(
            project=settings.project or os.environ.get("WANDB_PROJECT") or "iga-ds",
            name=settings.run_name or os.environ.get("WANDB_NAME") or out.resolve().name,
            dir=None if os.environ.get("WANDB_DIR") else str(out), config=params,
            id=run_id, resume="allow" if run_id else None, settings=wandb.Settings(silent=quiet))
        self.id = self.run.id

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=1 if status == "FAILED" else 0)


class MlflowRun:
    def __init__(self, out: Path, settings: LoggingConfig, params: dict[str, Any], run_id: str | None):
        from mlflow.entities import Param  # optional: the tracking extra
        from mlflow.tracking import MlflowClient

        self.uri = _mlflow_uri(out, settings)
        if urlsplit(self.uri).scheme in ("", "file"):
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless this is set;
            # it is what a run folder can carry without a database client (mlflow-skinny has none)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = MlflowClient(tracking_uri=self.uri)
        if run_id is not None and _run_exists(client, run_id):
            self.id = run_id
            client.update_run(run_id, status="RUNNING")  # params stay those of its first start
            return
        name = settings.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "iga-ds"
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        run_name = settings.run_name or os.environ.get("MLFLOW_RUN_NAME") or out.resolve().name
        self.id = client.create_run(experiment_id, run_name=run_name).info.run_id
        items = [Param(key, value if isinstance(value, str) else json.dumps(value)) for key, value in params.items()]
        for i in range(0, len(items), 100):  # log_batch takes 100 params at a time
            client.log_batch(self.id, params=items[i:i + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.id, status)


def _run_exists(client, run_id: str) -> bool:
    try:
        client.get_run(run_id)
    except Exception:  # mlflow's MlflowException: not in this store
        return False
    return True


class Trackers:
    """The W&B and MLflow runs of rank 0 (none elsewhere, or when ``report_to`` names neither)."""

    def __init__(self, out: Path, settings: LoggingConfig, resumed: bool, active: bool, quiet: bool = False):
        require_trackers(settings)  # every rank: all of them stop, not only rank 0
        self.runs: dict[str, Any] = {}
        wanted = [name for name in settings.report_to if name in CLIENTS]
        if not active or not wanted:
            return
        self.out = out
        ids = _read_ids(out / TRACKING_FILE) if resumed else {}
        params = flat_params(read_yaml_file(out / RUN_CONFIG)) if (out / RUN_CONFIG).is_file() else {}
        try:
            for name in wanted:
                self.runs[name] = self._start(name, settings, params, ids, quiet)
        except Exception as exc:
            self.close("FAILED")
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"logging.report_to: {name} could not start a run: {first}") from exc
        mlflow = self.runs.get("mlflow")
        atomic_write_json(out / TRACKING_FILE, {"wandb": getattr(self.runs.get("wandb"), "id", None),
                                                "mlflow": {"uri": _without_password(mlflow.uri), "run_id": mlflow.id}
                                                if mlflow else None})

    def _start(self, name: str, settings: LoggingConfig, params: dict[str, Any], ids: dict[str, Any], quiet: bool):
        if name == "wandb":
            return WandbRun(self.out, settings, params, ids.get("wandb"), quiet)
        previous = ids.get("mlflow") or {}  # the stored run, where it is in the same store
        same_store = previous.get("uri") == _without_password(_mlflow_uri(self.out, settings))
        return MlflowRun(self.out, settings, params, previous.get("run_id") if same_store else None)

    def log(self, record: dict[str, Any]) -> None:
        if self.runs:
            values = scalars(record)
            for run in self.runs.values():
                run.log(values, record["step"])

    def close(self, status: str) -> None:
        """``status``: MLflow's word (FINISHED, KILLED: stopped before the last step, FAILED)."""
        runs, self.runs = self.runs, {}
        for name, run in runs.items():
            try:
                run.close(status)
            except Exception as exc:  # the training's outputs are written; a tracker's failure does not undo them
                log.warning("logging.report_to: closing the %s run failed: %s", name, exc)


def _mlflow_uri(out: Path, settings: LoggingConfig) -> str:
    return settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (out / "mlruns").resolve().as_uri()


def _without_password(uri: str) -> str:
    """A tracking URI as tracking.json keeps it: ``https://user:secret@host`` -> ``https://host``."""
    parts = urlsplit(uri)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl() if "@" in parts.netloc else uri


def _read_ids(path: Path) -> dict[str, Any]:
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}
