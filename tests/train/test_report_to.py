"""``logging.report_to``: Weights & Biases (offline mode) and MLflow (its file store) get the
scalars metrics.jsonl gets, the resolved config as params, and a finished run at the end and at a
stop; a resumed run continues the same tracker run. The config errors and the missing-client
error are tested whether or not the clients are installed."""
from __future__ import annotations

import contextlib
import json
import struct
import sys
from pathlib import Path

import pytest

from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl

API_KEY = "sentinel0api0key0" + "f" * 23  # 40 characters, as a W&B key has: must appear in no file
WANDB_REASON = "wandb is not installed (pip install wandb)"
MLFLOW_REASON = "mlflow is not installed (pip install mlflow-skinny)"


def _installed(name: str) -> bool:
    import importlib.util

    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


# -- config and the missing client: always run --------------------------------------------------


def test_an_unknown_tracker_is_a_one_line_config_error():
    from iga_ds.config.run import config_from_dict
    from iga_ds.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        config_from_dict({"logging": {"report_to": ["wandb", "tensorbord"]}})
    line = str(err.value)
    assert "logging.report_to" in line and "'tensorbord'" in line and "\n" not in line
    assert all(name in line for name in ("tensorboard", "wandb", "mlflow"))
    with pytest.raises(ConfigError, match=r"logging\.report_to: names tensorboard, but logging\.tensorboard is false"):
        config_from_dict({"logging": {"report_to": ["tensorboard"], "tensorboard": False}})
    assert config_from_dict({"logging": {"report_to": "mlflow"}}).logging.report_to == ["mlflow"]
    assert config_from_dict({}).logging.report_to == []


def test_params_are_flat_and_short_and_a_stored_uri_keeps_no_password():
    from iga_ds.train.trackers import _without_password, flat_params

    params = flat_params({"lora": {"r": 4, "target_modules": ["q_proj", "v_proj"], "rslora": False},
                          "tokenizer": None, "data": {"train": "x" * 400},
                          "resolved": {"world_size": 2, "deepspeed_config": {"train_batch_size": 8}, "iga": {}}})
    assert params == {"lora.r": 4, "lora.target_modules": '["q_proj", "v_proj"]', "lora.rslora": False,
                      "tokenizer": None, "data.train": "x" * 247 + "...", "resolved.world_size": 2,
                      "resolved.iga": "{}"}
    assert _without_password("https://me:secret@mlflow.example:5000/x") == "https://mlflow.example:5000/x"
    assert _without_password("file:///runs/a/mlruns") == "file:///runs/a/mlruns"


@pytest.mark.parametrize("name, install", [("wandb", "pip install wandb"), ("mlflow", "pip install mlflow-skinny")])
@pytest.mark.parametrize("active", [True, False])
def test_a_missing_client_stops_every_rank_before_a_step_naming_the_package(tmp_path, monkeypatch, name, install,
                                                                            active):
    from iga_ds.config.run import config_from_dict
    from iga_ds.errors import ConfigError
    from iga_ds.train.logbook import Logbook

    monkeypatch.setitem(sys.modules, name, None)  # as if not installed: its import fails
    settings = config_from_dict({"logging": {"report_to": [name], "progress": False}}).logging
    with pytest.raises(ConfigError) as err:
        Logbook(tmp_path, settings, 0, 3, "train", active=active, quiet=True)
    line = str(err.value)
    assert line.startswith(f"logging.report_to: {name} is not installed: {install}") and "\n" not in line
    assert not (tmp_path / "metrics.jsonl").exists()


# -- a real run, stopped at step 2 and resumed to step 3 ----------------------------------------


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Every installed client in report_to; offline, stores under tmp; a sentinel API key set."""
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    wanted = [name for name in ("wandb", "mlflow") if _installed(name)]
    if not wanted:
        pytest.skip("neither wandb nor mlflow is installed (pip install 'iga-ds[tracking]')")
    tmp = tmp_path_factory.mktemp("report_to")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=4, seed=4)
    base = tiny_base(tmp, data)
    raw = run_config_dict(tmp, data, output_dir=str(tmp / "out"), **{
        "schedule.max_steps": 3, "checkpoint.stop_at_step": 2, "logging.report_to": wanted,
        "logging.tensorboard": False, "logging.project": "iga-ds-test", "logging.run_name": "tracked"})
    results = []
    with pytest.MonkeyPatch.context() as env:
        for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID"):
            env.delenv(key, raising=False)
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(tmp / "wandb_dir"))
        env.setenv("WANDB_API_KEY", API_KEY)
        env.setenv("WANDB_SILENT", "true")
        for _ in range(2):  # stopped at step 2, then resumed to the end
            results.append(Trainer(config_from_dict(raw), base_model_dir=str(base), quiet=True).run())
    out = tmp / "out"
    scalars = [{k: v for k, v in json.loads(line).items() if k != "step" and isinstance(v, (int, float))}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    return tmp, out, results, scalars


@pytest.mark.slow
def test_the_run_stopped_and_resumed_and_metrics_jsonl_has_each_step_once(tracked):
    _, out, results, scalars = tracked
    assert [r.status for r in results] == ["stopped", "completed"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert {"loss", "lr", "update_norm"} <= set(scalars[0])


@pytest.mark.slow
def test_no_file_holds_the_api_key(tracked):
    tmp = tracked[0]
    for path in tmp.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), path


def wandb_records(path: Path):
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log: a 7-byte
    header, 32 KiB blocks of chunks with a 7-byte header each: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # full or first; middle or last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


@pytest.mark.slow
def test_wandb_offline_run_has_the_scalars_of_metrics_jsonl_and_the_config(tracked):
    pytest.importorskip("wandb", reason=WANDB_REASON)
    tmp, out, _, scalars = tracked
    run_id = json.loads((out / "tracking.json").read_text())["wandb"]
    files = sorted((tmp / "wandb_dir" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # the stopped run and its resumption: one W&B run, synced as one
    history, config, exits, names = {}, {}, [], set()
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
            elif kind == "run":
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
                names.add((record.run.project, record.run.display_name))
            elif kind == "exit":
                exits.append(record.exit.exit_code)
    assert sorted(history) == [1, 2, 3]
    for step, want in enumerate(scalars, start=1):
        assert history[step] == pytest.approx(want, rel=1e-12), step
    assert exits == [0, 0]  # finished at the stop and at the end
    assert names == {("iga-ds-test", "tracked")}
    assert config["lora.r"] == 4 and config["resolved.world_size"] == 1
    assert json.loads(config["lora.target_modules"]) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert not any(key.startswith("resolved.deepspeed_config") for key in config)


@pytest.mark.slow
def test_mlflow_file_store_has_the_scalars_of_metrics_jsonl_and_the_params(tracked):
    pytest.importorskip("mlflow", reason=MLFLOW_REASON)
    from mlflow.tracking import MlflowClient

    _, out, _, scalars = tracked
    stored = json.loads((out / "tracking.json").read_text())["mlflow"]
    assert stored["uri"] == (out / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=stored["uri"])
    run = client.get_run(stored["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert client.get_experiment(run.info.experiment_id).name == "iga-ds-test"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the resume continued it
    for key in scalars[0]:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(step, pytest.approx(row[key], rel=1e-12)) for step, row in enumerate(scalars, start=1)]
    assert set(run.data.metrics) == set(scalars[0])
    params = run.data.params
    assert params["lora.r"] == "4" and params["schedule.max_steps"] == "3" and params["method.name"] == "erm"
    assert all(len(value) <= 250 for value in params.values())


def test_mlflow_marks_a_stop_killed_and_an_error_failed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason=MLFLOW_REASON)
    from mlflow.tracking import MlflowClient

    from iga_ds.config.run import config_from_dict
    from iga_ds.train.logbook import Logbook

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    settings = config_from_dict({"logging": {"report_to": ["mlflow"], "progress": False, "tensorboard": False}}).logging
    statuses = []
    for out, fail in ((tmp_path / "stopped", False), (tmp_path / "failed", True)):
        out.mkdir()
        book = Logbook(out, settings, 0, 5, "train", active=True, quiet=True)
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
            try:
                book.write({"step": 1, "loss": 1.0, "lr": 0.1})
                if fail:
                    raise RuntimeError("a step failed")
            finally:
                book.close()
        stored = json.loads((out / "tracking.json").read_text())["mlflow"]
        statuses.append(MlflowClient(tracking_uri=stored["uri"]).get_run(stored["run_id"]).info.status)
    assert statuses == ["KILLED", "FAILED"]


@pytest.mark.slow
def test_the_cli_says_a_missing_client_in_one_line(tmp_path, monkeypatch, capsys):
    """The trainer opens its logbook before step 1: a short run with a hidden client exits 2."""
    import yaml

    from iga_ds.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=2, seed=1)
    raw = run_config_dict(tmp_path, data, **{"schedule.max_steps": 1, "logging.report_to": ["wandb"],
                                             "model.name_or_path": str(tiny_base(tmp_path, data))})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "iga-ds: error: logging.report_to: wandb is not installed: pip install wandb " \
                  "(or pip install 'iga-ds[tracking]')"
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step ran
