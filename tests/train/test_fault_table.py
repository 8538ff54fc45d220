"""The fault table of issue 61, row by row: what a hostile or unlucky user tries, and what the run
must do (an exit status and one line naming what is wrong, or the documented recovery) and
leave on disk. Tiny CPU runs of a few steps over one module-scoped base and checkpoint."""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parents[2]
TINY_CPU = str(REPO / "configs" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny base, its data, and a run stopped at step 2 of 4 with checkpoints at steps 1 and 2."""
    tmp = tmp_path_factory.mktemp("faults")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=4, seed=2)
    base = tiny_base(tmp, data)
    first = _train(tmp, data, base, tmp / "stopped", **{"checkpoint.every_steps": 1, "checkpoint.stop_at_step": 2})
    assert first.status == "stopped" and first.step == 2
    return tmp, data, base, tmp / "stopped"


def _train(tmp, data, base, out, **over):
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    raw = run_config_dict(tmp, data, output_dir=str(out), **{"schedule.max_steps": 4, **over})
    return Trainer(config_from_dict(raw), base_model_dir=str(base), quiet=True).run()


def _refused(run, *parts: str) -> str:
    """The one line a refused run ends with: a UserError (exit 2 on the command line) naming ``parts``."""
    from iga_ds.errors import UserError

    with pytest.raises(UserError) as caught:
        run()
    line = str(caught.value)
    assert "\n" not in line and caught.value.exit_code == 2, line
    for part in parts:
        assert part in line, line
    return line


def _copy_run(stopped: Path, tmp: Path, name: str) -> Path:
    out = tmp / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(stopped, out)
    return out


def _metric_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


# -- rows that the config refuses: `iga-ds train` exits 2 with one line, before anything loads ----

CONFIG_ROWS = [
    ("schedule.lr=.inf", "schedule.lr: expected a positive number (finite), got inf"),
    ("schedule.weight_decay=.inf", "schedule.weight_decay: expected a non-negative number (finite), got inf"),
    ("schedule.betas=[0.9, .nan]", "schedule.betas[1]: expected"),
    ("method.params={tau: .nan}", "method.params.tau: expected a finite number, got nan"),
    ("method.params={tau: 0.5, normalize: snr, scales: [1.0, -.inf]}", "method.params.scales[1]: expected a finite"),
    ("checkpoint.allow_changes=[schedule.optimizer]", "schedule.optimizer cannot change on a resume"),
]


@pytest.mark.parametrize("override, line", CONFIG_ROWS, ids=[row[0] for row in CONFIG_ROWS])
def test_a_non_finite_setting_is_one_line_and_exit_2(override, line, tmp_path, capsys):
    from iga_ds.cli import main

    out = tmp_path / "out"
    assert main(["train", "--config", TINY_CPU, f"output_dir={out}", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("iga-ds: error: ") and "\n" not in err and line in err, err
    assert not out.exists()  # nothing written


JSON_ROWS = [
    ({"timeout_s": 0}, "iga.timeout_s: expected a positive number of seconds, got 0"),
    ({"params": {"tau": float("nan")}}, "iga.params.tau: expected a finite number, got nan"),
    ({"max_skipped_steps": -1}, "iga.max_skipped_steps: expected an integer >= 0"),
    ({"check_every_steps": -1}, "iga.check_every_steps: expected an integer >= 0"),
]


@pytest.mark.parametrize("block, line", JSON_ROWS, ids=[next(iter(row[0])) for row in JSON_ROWS])
def test_a_bad_iga_key_of_the_deepspeed_json_names_iga(block, line):
    """Named as the JSON's `iga.KEY`, also when the run YAML sets the method (it named
    `method.timeout_s`, a key that does not exist)."""
    from iga_ds.config.deepspeed import resolve_hook_config
    from iga_ds.config.run import config_from_dict
    from iga_ds.errors import ConfigError

    run = config_from_dict({"method": {"name": "iga"}})  # the method from the run YAML, its parameters from the JSON
    with pytest.raises(ConfigError) as caught:
        resolve_hook_config(run, {"seed": 0, **block}, source="zero2.json")
    assert str(caught.value).startswith("zero2.json: ") and line in str(caught.value), caught.value


# -- non-finite training never succeeds ------------------------------------------------------------


def test_a_diverged_run_stops_after_the_skipped_step_limit(setup, tmp_path):
    """A learning rate that blows the weights up: every step after the first is skipped, and
    the run stops at the limit naming the loss, with no adapter ("done" before)."""
    tmp, data, base, _ = setup
    ds = json.loads((REPO / "ds_configs" / "zero2_fp32.json").read_text())
    ds["iga"]["max_skipped_steps"] = 2
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "diverged"
    _refused(lambda: _train(tmp, data, base, out, deepspeed=str(tmp_path / "ds.json"), **{"schedule.lr": 1e30}),
             "step 3: 2 optimizer steps in a row skipped", "the first at step 2 (the loss was nan)")
    assert _metric_steps(out) == [1, 2, 3] and not (out / "adapter").exists()


def _poison_after(monkeypatch, step: int, where: str):
    """Make the LoRA weights NaN after optimizer step ``step`` (``where="after"``), or make the
    loss NaN at every step up to ``step`` (``where="loss"``): what an infinite lr did, in a test."""
    import torch

    from iga_ds.engine.hook import EngineHook
    from iga_ds.train.trainer import Trainer

    if where == "after":
        original = Trainer.train_step

        def train_step(self, s, at):
            record = original(self, s, at)
            if at + 1 >= step:
                with torch.no_grad():
                    for p in s.engine.module.parameters():
                        if p.requires_grad:
                            p.fill_(float("nan"))
            return record

        monkeypatch.setattr(Trainer, "train_step", train_step)
    else:
        objective = EngineHook.objective

        def nan_objective(self, losses, ids, scale=None):
            poisoned = int(self.engine.global_steps) < step
            return objective(self, losses * float("nan") if poisoned else losses, ids, scale)

        monkeypatch.setattr(EngineHook, "objective", nan_objective)


def test_non_finite_weights_are_never_saved_and_never_done(setup, tmp_path, monkeypatch):
    tmp, data, base, _ = setup
    _poison_after(monkeypatch, 3, "after")
    out = tmp_path / "poisoned"
    _refused(lambda: _train(tmp, data, base, out, **{"schedule.max_steps": 3, "checkpoint.every_steps": 1}),
             "the checkpoint of step 3: 8 of 8 LoRA tensors hold NaN", "not written")
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    assert not (out / "adapter").exists() and not list((out / "checkpoints").glob("partial-*"))


def test_skipped_steps_in_a_row_count_the_hooks_skips_and_deepspeeds():
    from iga_ds.train.divergence import DivergedRun, SkippedSteps

    finite = {"loss": 1.0, "grad_norm": 0.5}
    watch = SkippedSteps(limit=2)
    watch.observe({"step": 1, **finite, "hook.skipped": 1.0})
    watch.observe({"step": 2, **finite, "hook.skipped": 0.0})  # a good step: the row starts over
    watch.observe({"step": 3, "loss": float("inf"), "grad_norm": None, "hook.skipped": 1.0})
    with pytest.raises(DivergedRun, match=r"^step 4: 2 optimizer steps in a row skipped .* the first at step 3 "
                                          r"\(the loss was inf\)"):
        watch.observe({"step": 4, **finite}, skipped=True)  # DeepSpeed's own overflow check skipped it
    never = SkippedSteps(limit=0)
    for step in range(1, 10):
        never.observe({"step": step, "loss": float("nan"), "hook.skipped": 1.0})


def test_the_adapter_is_checked_finite_before_done():
    import torch

    from iga_ds.train.divergence import check_finite_weights

    module = torch.nn.Linear(2, 2)
    check_finite_weights(module, "the adapter x")  # finite: nothing said
    with torch.no_grad():
        module.bias[1] = float("inf")
    _refused(lambda: check_finite_weights(module, "the adapter x"), "the adapter x: 1 of 2 LoRA tensors",
             "(the first: bias)")


def test_a_checkpoint_before_the_first_optimizer_step_saves_and_resumes(setup, tmp_path, monkeypatch):
    """Every step so far skipped, then a stop (stop_at_step acts as a signal does): a checkpoint
    (DeepSpeed's gather of the optimizer state raised a TypeError), and a resume from it."""
    tmp, data, base, _ = setup
    out = tmp_path / "skipped-first"
    with monkeypatch.context() as patch:
        _poison_after(patch, 1, "loss")
        first = _train(tmp, data, base, out, **{"checkpoint.stop_at_step": 1})
    assert first.status == "stopped" and first.history[0]["hook.skipped"] == 1.0
    assert _ckpt(out, 1).is_dir() and not list((out / "checkpoints").glob("partial-*"))
    second = _train(tmp, data, base, out)
    assert second.status == "completed" and [h["step"] for h in second.history] == [2, 3, 4]
    assert second.history[0].get("hook.skipped") == 0.0


# -- a resume checks what it resumes -------------------------------------------------------------

CHANGED_RUNS = [
    ({"method.name": "iga", "method.params": {"tau": 0.5}}, "method.name 'erm' -> 'iga'",
     "checkpoint.allow_changes=[method.name,method.params]"),
    ({"lora.r": 2}, "lora.r 4 -> 2", "checkpoint.allow_changes=[lora.r]"),
    ({"lora.target_modules": ["q_proj"]}, "lora.target_modules", "checkpoint.allow_changes=[lora.target_modules]"),
    ({"schedule.optimizer": "sgd", "checkpoint.allow_schedule_change": True}, "another optimizer", "resume=never"),
]


@pytest.mark.parametrize("over, change, fix", CHANGED_RUNS, ids=["method", "lora.r", "target_modules", "optimizer"])
def test_a_resume_that_changes_the_run_is_refused_naming_each_change(setup, over, change, fix):
    tmp, data, base, stopped = setup
    before = sorted(p.name for p in (stopped / "checkpoints").iterdir())
    metrics = (stopped / "metrics.jsonl").read_text()
    _refused(lambda: _train(tmp, data, base, stopped, **over), f"resume: {_ckpt(stopped, 2)}", change, fix)
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == before
    assert (stopped / "metrics.jsonl").read_text() == metrics  # nothing truncated, nothing mixed


def test_an_allowed_change_resumes(setup, tmp_path):
    tmp, data, base, stopped = setup
    out = _copy_run(stopped, tmp_path, "allowed")
    other = write_isomer_jsonl(tmp_path / "other.jsonl", groups=4, seed=9)
    result = _train(tmp, other, base, out, **{"checkpoint.allow_changes": ["data.train"]})
    assert result.status == "completed" and [h["step"] for h in result.history] == [3, 4]


@pytest.mark.parametrize("latest", ["deleted", "dangling"])
def test_latest_missing_or_dangling_resumes_from_the_newest_step(setup, tmp_path, latest):
    """It started over at step 0 and truncated metrics.jsonl."""
    tmp, data, base, stopped = setup
    out = _copy_run(stopped, tmp_path, latest)
    if latest == "deleted":
        (out / "checkpoints" / "latest").unlink()
    else:
        (out / "checkpoints" / "latest").write_text("step_00000009")
    from iga_ds.train.checkpoint import resolve_resume

    notes = []
    assert resolve_resume("auto", out / "checkpoints", note=notes.append) == _ckpt(out, 2)
    assert len(notes) == 1 and "resuming from the newest complete checkpoint" in notes[0], notes
    if latest == "dangling":
        result = _train(tmp, data, base, out)
        assert result.status == "completed" and [h["step"] for h in result.history] == [3, 4]
        assert _metric_steps(out) == [1, 2, 3, 4]


def test_a_second_run_into_the_same_folder_is_refused_naming_the_holder(setup, tmp_path):
    """Two runs at once into one folder: both ran, interleaved. The holder here is another process."""
    tmp, data, base, stopped = setup
    out = _copy_run(stopped, tmp_path, "locked")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from iga_ds.train.lock import RunLock; "
         "RunLock(sys.argv[2]).acquire(); print('held', flush=True); sys.stdin.read()", str(REPO), str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        metrics = (out / "metrics.jsonl").read_text()
        _refused(lambda: _train(tmp, data, base, out), f"output_dir {out}: another run is writing to it",
                 f"pid {holder.pid} on host ")
        assert (out / "metrics.jsonl").read_text() == metrics
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    from iga_ds.train.lock import RunLock

    RunLock(out).acquire().release()  # the kernel let go of it with the holder


CORRUPT_FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank00000.pt",
                 "optimizer_full.safetensors", "meta.json"]


@pytest.mark.parametrize("name", CORRUPT_FILES)
def test_a_truncated_checkpoint_file_is_named_in_one_line(setup, tmp_path, name):
    from iga_ds.train.checkpoint import check_checkpoint_files, read_checkpoint_meta

    _, _, _, stopped = setup
    folder = tmp_path / "step_00000002"
    shutil.copytree(_ckpt(stopped, 2), folder)
    file = folder / name
    assert file.is_file(), sorted(p.name for p in folder.iterdir())
    check_checkpoint_files(folder)
    read_checkpoint_meta(folder)  # whole: nothing said
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    _refused(lambda: (check_checkpoint_files(folder), read_checkpoint_meta(folder)), f"resume: {file}: ",
             "truncated or corrupt", "resume: never")


def test_a_corrupt_byte_in_a_torch_file_fails_its_crc(setup, tmp_path):
    from iga_ds.train.checkpoint import check_checkpoint_files

    _, _, _, stopped = setup
    folder = tmp_path / "step_00000002"
    shutil.copytree(_ckpt(stopped, 2), folder)
    file = folder / "rng_rank00000.pt"
    raw = bytearray(file.read_bytes())
    head = raw.index(b"PK\x03\x04")  # the first member's local header: 30 bytes, its name, its extra field
    start = head + 30 + int.from_bytes(raw[head + 26:head + 28], "little") + \
        int.from_bytes(raw[head + 28:head + 30], "little")
    raw[start + 4] ^= 0xFF  # a byte of the first member's data
    file.write_bytes(bytes(raw))
    _refused(lambda: check_checkpoint_files(folder), f"resume: {file}: corrupt", "CRC")


def test_a_resume_from_a_truncated_model_state_stops_in_one_line(setup, tmp_path):
    tmp, data, base, stopped = setup
    out = _copy_run(stopped, tmp_path, "truncated")
    file = _ckpt(out, 2) / "mp_rank_00_model_states.pt"
    file.write_bytes(file.read_bytes()[:100])
    _refused(lambda: _train(tmp, data, base, out), f"resume: {file}: truncated or corrupt")


def test_previous_good_resumes_from_the_newest_checkpoint_that_reads_whole(setup, tmp_path):
    """The newest checkpoint truncated: `resume: previous-good` names it, passes over it and
    resumes from the one before; metrics.jsonl keeps one line a step."""
    tmp, data, base, stopped = setup
    out = _copy_run(stopped, tmp_path, "previous-good")
    file = _ckpt(out, 2) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    file.write_bytes(file.read_bytes()[:100])
    from iga_ds.train.checkpoint import resolve_resume

    notes = []
    assert resolve_resume("previous-good", out / "checkpoints", note=notes.append) == _ckpt(out, 1)
    assert len(notes) == 1 and notes[0].startswith(f"resume: previous-good: passing over step_00000002: resume: {file}: "
                                                    "truncated or corrupt"), notes
    result = _train(tmp, data, base, out, resume="previous-good")
    assert result.status == "completed" and [h["step"] for h in result.history] == [2, 3, 4]
    assert _metric_steps(out) == [1, 2, 3, 4]
    kept = sorted((out / "checkpoints").glob("step_*"))
    for folder in kept:  # none reads whole now: refused, never a silent start over
        (folder / "meta.json").write_text("{")
    _refused(lambda: resolve_resume("previous-good", out / "checkpoints", note=notes.append),
             f"resume: previous-good: none of the {len(kept)} checkpoints", "resume: never")


# -- faults are one line --------------------------------------------------------------------------


def test_an_old_checkpoint_that_does_not_fit_is_one_line(setup, tmp_path):
    """A checkpoint saved before meta.json recorded the run, resumed with another LoRA rank:
    DeepSpeed's own error (a size mismatch) becomes one line naming the checkpoint."""
    tmp, data, base, stopped = setup
    out = _copy_run(stopped, tmp_path, "old")
    meta = _ckpt(out, 2) / "meta.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "run"}))
    _refused(lambda: _train(tmp, data, base, out, **{"lora.r": 2}),
             f"resume: {_ckpt(out, 2)}: DeepSpeed cannot load it into this run", "resume: never")


@pytest.mark.parametrize("fault", ["model card", "torch.save"])
def test_a_full_disk_while_checkpointing_names_what_was_written_and_keeps_the_last(setup, tmp_path, monkeypatch,
                                                                                   fault):
    """ENOSPC from PEFT's model-card write (an OSError without a file name) was a traceback, as
    is torch.save's (a RuntimeError of its stream writer)."""
    import torch

    import iga_ds.train.trainer as trainer

    tmp, data, base, stopped = setup
    out = _copy_run(stopped, tmp_path, "full-disk")
    staging = out / "checkpoints" / "partial-step_00000003"
    if fault == "model card":
        def no_space(folder, *args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(trainer, "make_portable", no_space)
        said = (f"writing the adapter {staging / 'adapter'}", "No space left on device")
    else:
        save = torch.save

        def no_space(obj, f, *args, **kwargs):
            if str(f).startswith(str(staging)):
                raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing "
                                   "file data/0: file write failed")
            return save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", no_space)
        said = (f"writing the checkpoint of step 3 into {staging}", "PytorchStreamWriter failed writing")
    _refused(lambda: _train(tmp, data, base, out, **{"checkpoint.every_steps": 1}), *said,
             f"the last complete checkpoint, {_ckpt(out, 2)}, is intact")
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    assert not list((out / "checkpoints").glob("partial-*"))
    from iga_ds.train.checkpoint import check_checkpoint_files

    check_checkpoint_files(_ckpt(out, 2))


# -- security -------------------------------------------------------------------------------------


class _RunsCode:
    """Pickled as a call of ``open(path, "w")``: what unpickling it does is create ``path``."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_checkpoint_file_that_would_run_code_is_refused_unrun(setup, tmp_path, name):
    """DeepSpeed's loader unpickled its files (torch.load weights_only=False): a file carrying an
    object whose unpickling runs code ran it on resume. The checkpoint's own files still load
    (the resume of the row above), this one is refused in one line naming it and what it asked for."""
    import torch

    tmp, data, base, stopped = setup
    out = _copy_run(stopped, tmp_path, "planted")
    file, ran = _ckpt(out, 2) / name, tmp_path / "it-ran"
    state = torch.load(file, weights_only=False)
    state["planted"] = _RunsCode(ran)
    torch.save(state, file)
    _refused(lambda: _train(tmp, data, base, out), f"resume: {file}: refused to unpickle io.open",
             "resume only checkpoints that training wrote")
    assert not ran.exists()


def test_checkpoint_and_adapter_files_follow_the_umask(setup):
    _, _, _, stopped = setup
    want = 0o666 & ~_umask()
    files = [p for p in _ckpt(stopped, 2).rglob("*") if p.is_file()]
    assert any(p.name == "optimizer_full.safetensors" for p in files)
    assert any(p.name == "adapter_model.safetensors" for p in files)
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: oct(want) for p in files}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_credentials_in_the_teacher_url_are_never_shown(caplog):
    from iga_ds.data.teacher.clients import OpenAIChatClient, TeacherError, redact_url
    from iga_ds.errors import UserError

    assert redact_url("http://user:s3cret@host:8000/v1") == "http://***@host:8000/v1"
    assert redact_url("https://host/v1") == "https://host/v1"
    client = OpenAIChatClient("http://user:s3cret@127.0.0.1:9/v1", "m", max_retries=0, timeout=2)
    assert "s3cret" not in repr(client) and "user" not in repr(client) and "***@127.0.0.1:9" in repr(client)
    with pytest.raises(TeacherError) as caught:
        client.chat([{"role": "user", "content": "hi"}])
    assert "s3cret" not in str(caught.value) and "***@127.0.0.1:9" in str(caught.value), caught.value
    with pytest.raises(UserError) as bad:
        OpenAIChatClient("ftp://user:s3cret@host/v1", "m")
    assert "s3cret" not in str(bad.value)
    assert "s3cret" not in caplog.text
