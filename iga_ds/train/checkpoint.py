"""Checkpoints, resume and stop signals.

A checkpoint is a DeepSpeed checkpoint (``engine.save_checkpoint`` with frozen weights
excluded: only the LoRA factors, their optimizer state and the LR schedule) plus, in
``client_state``, the global step (the sampler needs nothing else), and one small file per
rank with its random-number generator states. Every rank writes into ``partial-step_<N>``; once
all of them are done, rank 0 renames it to ``step_<N>`` and then writes the ``latest`` tag file.
So a folder named ``step_*`` is always complete, and a run killed while saving (or a node lost)
resumes from the previous checkpoint and leaves only a ``partial-*`` folder, which the next
save removes (one log line per folder). Checkpoints live on a filesystem every rank sees.

Another world size (2 ranks -> 1, or the reverse): DeepSpeed's engine refuses to load ZeRO
optimizer partitions saved at another data-parallel size, so each checkpoint also holds
``optimizer_full.safetensors``, the Adam moments of every LoRA parameter gathered to full
size (``deepspeed.utils.safe_get_full_optimizer_state``). On a size change the weights come
from the DeepSpeed checkpoint (``zero_optimization.elastic_checkpoint`` merges the fp32
partitions of all saved ranks) and the moments from that file, set back into this run's
partitions with ``safe_set_full_optimizer_state``.

A method that carries state over steps (IGA's ``variance: ema``) has it saved beside: each
rank writes its share (:meth:`iga_ds.engine.hook.EngineHook.method_state`: under ZeRO the
modules it combines) as ``method_state_rank<R>.safetensors``; a resume reads every rank's file,
merges them into the full state and gives it to the hook, which hands each rank its own
modules' entries, at the saved world size or another.

SIGUSR1 and SIGTERM only raise a flag; the trainer checks it at the next step boundary (all
ranks agree through one all-reduce), saves, and exits 0, so Slurm can requeue the job
(``#SBATCH --signal=B:USR1@120`` and ``--requeue``). A file named ``STOP`` in the output
folder asks the same without a signal (``touch OUTPUT_DIR/STOP``): it reaches ranks whose
signal handler was replaced or whose signal got lost on the way, and the Slurm templates'
USR1 trap writes it beside forwarding the signal. The run removes the file once its
checkpoint is saved, and removes a file left over from an earlier run before it starts.

A resume checks what it resumes before DeepSpeed reads anything: ``latest`` missing or naming
a folder that is not there falls back to the newest ``step_*`` (said in the log); every file
of the checkpoint is read through once (a truncated or corrupt one is named in one line);
``meta.json`` holds the settings that define the run (``RUN_IDENTITY`` in the config), and a
resume that changes one is refused unless ``checkpoint.allow_changes`` names it. A failed write
(no space left, say) stops the run in one line naming what was being written; the staging
folder is removed and the last complete checkpoint stays as it was. One run writes to an output
folder at a time (:func:`lock_output_dir`).

Nothing of a checkpoint is unpickled: iga-ds's own files are safetensors, JSON and
``torch.load(weights_only=True)``, and DeepSpeed's loader is made to read its files the same
way (:func:`iga_ds.engine.internals.load_checkpoints_without_pickle`), so a file that names any
other object than tensors, plain values and DeepSpeed's few checkpoint classes is refused.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import zipfile
from pathlib import Path
from typing import Any, Callable

from iga_ds.config.run import NEVER_CHANGED
from iga_ds.engine.internals import (load_checkpoints_without_pickle, load_full_optimizer_state,
                                     save_full_optimizer_state)
from iga_ds.errors import ConfigError, UserError
from iga_ds.files import atomic_write_json, atomic_write_text, follow_umask
from iga_ds.train.lock import RunLock

log = logging.getLogger(__name__)

TAG_PREFIX = "step_"
# a checkpoint being written, one a lost rank left unfinished, or an older one being replaced
PARTIAL_PREFIX = "partial-"
FULL_OPTIMIZER_FILE = "optimizer_full.safetensors"
METHOD_STATE_PREFIX = "method_state_rank"


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The checkpoint folder named by DeepSpeed's ``latest`` file, or None."""
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text(encoding="utf-8").strip()
    path = Path(ckpt_dir) / tag
    return path if path.is_dir() else None


def newest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The ``step_*`` folder of the highest step (complete by construction: see above), or None."""
    steps = [p for p in Path(ckpt_dir).glob(f"{TAG_PREFIX}*") if p.is_dir() and re.fullmatch(r"step_\d+", p.name)]
    return max(steps, key=lambda p: int(p.name[len(TAG_PREFIX):]), default=None)


def resolve_resume(resume: str, ckpt_dir: Path, note: Callable[[str], None] = log.warning) -> Path | None:
    """``auto``: the latest checkpoint if there is one (``latest`` missing or dangling: the newest
    ``step_*``, and ``note`` says so); ``previous-good``: the newest ``step_*`` whose files read
    whole (:func:`newest_good_checkpoint`); ``never``: none; else a folder."""
    if resume == "never":
        return None
    if resume == "previous-good":
        return newest_good_checkpoint(ckpt_dir, note)
    if resume == "auto":
        latest = latest_checkpoint(ckpt_dir)
        newest = newest_checkpoint(ckpt_dir) if latest is None else None
        if newest is not None:
            tag_file = Path(ckpt_dir) / "latest"
            why = (f"names {tag_file.read_text(encoding='utf-8', errors='replace').strip()!r}, which is not there"
                   if tag_file.is_file() else "is missing")
            note(f"resume: {tag_file} {why}; resuming from the newest complete checkpoint, {newest}")
        return latest or newest
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"resume: expected auto, previous-good, never or a checkpoint folder, got {resume!r} "
                          "(not found)")
    if path.name.startswith(PARTIAL_PREFIX):
        raise ConfigError(f"resume: {path} is a checkpoint whose save did not finish; name a {TAG_PREFIX}* folder")
    return path


def newest_good_checkpoint(ckpt_dir: Path, note: Callable[[str], None] = log.warning) -> Path | None:
    """The newest ``step_*`` folder whose files all read whole (:func:`check_checkpoint_files`,
    :func:`read_checkpoint_meta`), ``note`` naming each newer one passed over and why; None
    without checkpoints. Checkpoints there, none whole: one line (never a silent start over)."""
    steps = sorted((p for p in Path(ckpt_dir).glob(f"{TAG_PREFIX}*") if p.is_dir() and re.fullmatch(r"step_\d+", p.name)),
                   key=lambda p: int(p.name[len(TAG_PREFIX):]), reverse=True)
    for path in steps:
        try:
            check_checkpoint_files(path)
            read_checkpoint_meta(path)
        except ConfigError as exc:
            note(f"resume: previous-good: passing over {path.name}: {str(exc).split('; ' + _RETRY)[0]}")
            continue
        return path
    if steps:
        raise ConfigError(f"resume: previous-good: none of the {len(steps)} checkpoints in {ckpt_dir} reads whole "
                          "(each is named above); start over with resume: never")
    return None


# -- random state ----------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    import numpy as np
    import torch

    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_tuples(obj: Any) -> Any:
    """torch.load(weights_only) returns lists where random.setstate needs tuples."""
    if isinstance(obj, list):
        return tuple(_to_tuples(x) for x in obj)
    return obj


def _rng_file(path: Path, rank: int) -> Path:
    return path / f"rng_rank{rank:05d}.pt"


# -- what a resume checks before it loads ----------------------------------------------------

META_FILE = "meta.json"
_RETRY = ("resume from the newest checkpoint that reads whole (resume: previous-good), another one "
          "(resume: PATH), or start over (resume: never)")


def read_checkpoint_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of checkpoint ``path`` ({} for a checkpoint that has none), or one line on
    what is wrong with it."""
    meta_file = path / META_FILE
    if not meta_file.is_file():
        return {}
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"resume: {meta_file}: not valid JSON, truncated or corrupt ({exc}); {_RETRY}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("world_size"), int):
        raise ConfigError(f"resume: {meta_file}: expected an object with the world size, got {meta!r}; {_RETRY}")
    return meta


def check_checkpoint_files(path: Path) -> None:
    """Every torch file (a zip archive: each member's CRC is checked) and safetensors file (its
    header against its size) of checkpoint ``path`` reads whole, or one line naming the file."""
    for file in sorted(path.iterdir()):
        problem = _zip_problem(file) if file.suffix == ".pt" else \
            _safetensors_problem(file) if file.suffix == ".safetensors" else None
        if problem:
            raise ConfigError(f"resume: {file}: {problem}; {_RETRY}")


def _zip_problem(file: Path) -> str | None:
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        return f"truncated or corrupt, not a whole torch file ({exc})"
    return f"corrupt: {bad} fails its CRC check" if bad is not None else None


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= size - 8:
                return f"truncated or corrupt: a header of {length} bytes in a file of {size}"
            header = json.loads(f.read(length))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError, IndexError) as exc:
        return f"truncated or corrupt: its header is not a safetensors header ({exc})"
    expected = 8 + length + max(ends, default=0)
    return f"truncated or corrupt: {size} bytes where its header says {expected}" if expected != size else None


def identity_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, ``old -> new``) for each setting that defines the run and differs from the one a
    checkpoint was saved under (none for a checkpoint that recorded none, nor for a key it lacks)."""
    saved = saved or {}
    now = json.loads(json.dumps(current))  # tuples as lists, as the saved side reads them
    return [(key, f"{saved[key]!r} -> {now[key]!r}") for key in now if key in saved and saved[key] != now[key]]


def check_run_identity(path: Path, saved: dict[str, Any] | None, current: dict[str, Any],
                       allowed: list[str]) -> list[str]:
    """Refuse, in one line naming each change, to resume ``path`` as another run (the method, its
    parameters, LoRA, the data, the base) unless ``allowed`` (``checkpoint.allow_changes``) names
    the key; an optimizer change always. Returns the keys whose change is allowed."""
    changes = identity_changes(saved, current)
    said = "; ".join(f"{key} {change}" for key, change in changes)
    if any(key in NEVER_CHANGED for key, _ in changes):
        raise ConfigError(f"resume: {path} was saved with another optimizer ({said}); its state does not fit "
                          "this one: resume=never to start over")
    refused = [key for key, _ in changes if key not in allowed]
    if refused:
        raise ConfigError(f"resume: {path} was saved by another run ({said}); set "
                          f"checkpoint.allow_changes=[{','.join(refused)}] to continue it under these settings, or "
                          "resume=never to start over")
    return [key for key, _ in changes]


# -- the method's state ----------------------------------------------------------------------


def _method_state_file(path: Path, rank: int) -> Path:
    return path / f"{METHOD_STATE_PREFIX}{rank:05d}.safetensors"


def save_method_state(path: Path, rank: int, state: dict[str, Any]) -> None:
    """This rank's share of the method's state into ``path`` (nothing when it has none)."""
    if not state:
        return
    from safetensors.torch import save_file

    target = _method_state_file(path, rank)
    tmp = target.with_suffix(".tmp")
    save_file({key: t.detach().cpu().contiguous() for key, t in state.items()}, str(tmp))
    follow_umask(tmp)  # save_file makes it 0600
    os.replace(tmp, target)


def read_method_state(path: Path) -> dict[str, Any]:
    """Every rank's share of the method's state saved in checkpoint ``path``, merged: the full state."""
    from safetensors.torch import load_file

    merged: dict[str, Any] = {}
    for share in sorted(path.glob(f"{METHOD_STATE_PREFIX}*.safetensors")):
        for key, tensor in load_file(str(share)).items():
            if key in merged:
                raise ConfigError(f"resume: {path}: method state {key!r} saved by two ranks")
            merged[key] = tensor
    return merged


# -- save / load -----------------------------------------------------------------------------


def save_checkpoint(
    engine,
    ckpt_dir: Path,
    step: int,
    client_state: dict[str, Any],
    rank: int,
    keep_last: int,
    save_adapter: Callable[[Path], None] | None = None,
    method_state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Save on every rank (DeepSpeed's call is collective); rank 0 also writes the adapter,
    puts the finished folder in place and prunes old checkpoints. ``method_state``: this rank's
    share of the method's state (:func:`save_method_state`); ``meta``: more of ``meta.json``
    (the run's identity). Returns the checkpoint folder. A failed write is one line naming it."""
    staging = ckpt_dir / f"{PARTIAL_PREFIX}{tag_for(step)}"
    try:
        return _write_checkpoint(engine, ckpt_dir, step, client_state, rank, keep_last, save_adapter,
                                 method_state, meta or {})
    except (OSError, RuntimeError, UserError) as exc:  # UserError: the adapter's write, said already
        if isinstance(exc, RuntimeError) and not is_write_failure(exc):
            raise
        shutil.rmtree(staging, ignore_errors=True)  # frees the space it took; the last checkpoint stays
        kept = latest_checkpoint(ckpt_dir)
        what = str(exc) if isinstance(exc, UserError) else \
            f"writing the checkpoint of step {step} into {staging}: {write_failure(exc)}"
        raise UserError(f"{what}; " + (f"the last complete checkpoint, {kept}, is intact" if kept else
                                       "no earlier checkpoint")) from None


def is_write_failure(exc: RuntimeError) -> bool:
    """torch.save reports a failed write (a full disk) as a RuntimeError of its stream writer."""
    return "PytorchStreamWriter" in str(exc) or "file write failed" in str(exc)


def write_failure(exc: BaseException) -> str:
    """What went wrong in a write, in words: ``No space left on device (FILE)``."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _write_checkpoint(engine, ckpt_dir: Path, step: int, client_state: dict[str, Any], rank: int, keep_last: int,
                      save_adapter: Callable[[Path], None] | None, method_state: dict[str, Any] | None,
                      meta: dict[str, Any]) -> Path:
    """The save, in steps that every rank passes together (:func:`written_by_every_rank`)."""
    import torch

    tag = tag_for(step)
    final = ckpt_dir / tag
    staging = ckpt_dir / f"{PARTIAL_PREFIX}{tag}"

    def clear():
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            # an interrupted save of this step would mix its files (another world size's ZeRO
            # partitions, say) into this one
            remove_partial_checkpoints(ckpt_dir)

    written_by_every_rank(clear, step)  # no rank writes before the leftovers are gone

    def own_part():  # what this rank writes alone
        staging.mkdir(parents=True, exist_ok=True)
        tmp = _rng_file(staging, rank).with_suffix(".tmp")
        torch.save(capture_rng(), tmp)
        os.replace(tmp, _rng_file(staging, rank))
        save_method_state(staging, rank, method_state or {})

    def gathered_part():  # a collective gather, then rank 0's files
        save_full_optimizer_state(engine, staging / FULL_OPTIMIZER_FILE, rank)
        if rank == 0:
            if (staging / FULL_OPTIMIZER_FILE).is_file():
                follow_umask(staging / FULL_OPTIMIZER_FILE)  # safetensors' save_file makes it 0600
            atomic_write_json(staging / META_FILE, {**meta, "step": step, "world_size": _world_size()})
            if save_adapter is not None:
                save_adapter(staging / "adapter")

    written_by_every_rank(own_part, step)
    written_by_every_rank(gathered_part, step)  # past it, no rank is still writing
    # DeepSpeed writes its `latest` on rank 0 before the other ranks are done writing theirs; a
    # node lost in between would leave `latest` naming a half-written checkpoint. Its save ends
    # in a barrier, so past it every rank's part is on disk: only then does the folder get its
    # step name and `latest` name it. The files in it do not depend on the folder's name, so
    # DeepSpeed's loader reads the renamed folder as its own.
    engine.save_checkpoint(str(ckpt_dir), tag=staging.name, client_state=client_state,
                           exclude_frozen_parameters=True, save_latest=False)
    def into_place():
        if rank == 0:
            _move_into_place(staging, final)
            atomic_write_text(ckpt_dir / "latest", tag)
            prune_checkpoints(ckpt_dir, keep_last)

    written_by_every_rank(into_place, step)
    return final


def written_by_every_rank(write: Callable[[], None], step: int) -> None:
    """Run this rank's ``write``, then agree with the other ranks on whether all of theirs
    succeeded: where one failed, every rank stops with an error (the failed one with its own),
    so that none waits in a later collective for a rank that has left."""
    import torch
    import torch.distributed as dist

    failure = None
    try:
        write()
    except (OSError, RuntimeError, UserError) as exc:
        failure = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        # NCCL reduces CUDA tensors only; gloo (and a CPU part of a mixed backend) CPU ones
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        flags = torch.zeros(dist.get_world_size(), dtype=torch.float32, device=device)
        flags[dist.get_rank()] = float(failure is not None)
        dist.all_reduce(flags)
        failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    else:
        failed = []
    if failure is not None:
        raise failure
    if failed:
        ranks = ", ".join(map(str, failed))
        raise UserError(f"writing the checkpoint of step {step}: rank {ranks} could not write its part "
                        f"(its own error says why)")


def _move_into_place(staging: Path, final: Path) -> None:
    """Rename the finished ``staging`` folder to ``final``. A folder already there (a run that
    started over with ``resume: never``) is renamed aside first, since a rename cannot replace a
    folder that is not empty; a crash in between leaves it to :func:`remove_partial_checkpoints`."""
    if final.exists():
        replaced = final.with_name(f"{PARTIAL_PREFIX}{final.name}.replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
        os.rename(staging, final)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        os.rename(staging, final)


def remove_partial_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Remove the ``partial-*`` folders a save left when a rank or node was lost mid-save (one
    rank, while no save is running); logs one line per folder and returns them."""
    removed = []
    for folder in sorted(ckpt_dir.glob(f"{PARTIAL_PREFIX}*")):
        if folder.is_dir():
            log.warning("removing %s, left by a checkpoint save that did not finish", folder)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def prune_checkpoints(ckpt_dir: Path, keep_last: int) -> None:
    tags = sorted(p for p in ckpt_dir.glob(f"{TAG_PREFIX}*") if p.is_dir())
    latest = latest_checkpoint(ckpt_dir)
    for old in tags[:-keep_last]:
        if latest is None or old.resolve() != latest.resolve():
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(engine, path: Path, rank: int) -> dict[str, Any]:
    """Restore LoRA weights, optimizer, schedule and this rank's random state; return the
    client state. A rank that did not exist when saving takes rank 0's random state."""
    import torch

    saved_world = read_checkpoint_meta(path).get("world_size", _world_size())
    same_world = saved_world == _world_size()
    if not same_world and not engine.zero_elastic_checkpoint():
        raise ConfigError(
            f"resume: {path} was saved by {saved_world} ranks and this run has {_world_size()}; "
            "that needs zero_optimization.elastic_checkpoint true in the DeepSpeed config"
        )
    load_checkpoints_without_pickle(engine)  # a checkpoint from elsewhere cannot run code
    # frozen weights are not in the file, so the module load cannot be strict
    try:
        load_path, client = engine.load_checkpoint(
            str(path.parent), tag=path.name, load_module_strict=False, load_optimizer_states=same_world,
            load_lr_scheduler_states=True,
        )
    except (RuntimeError, KeyError, ValueError, IndexError, EOFError) as exc:
        # a checkpoint older than the run record in meta.json, saved with other LoRA shapes (say)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"resume: {path}: DeepSpeed cannot load it into this run ({type(exc).__name__}: "
                          f"{first[:200]}); it was saved by another run, or is damaged; {_RETRY}") from None
    if load_path is None:
        raise ConfigError(f"resume: {path} is not a DeepSpeed checkpoint")
    if not same_world:
        load_full_optimizer_state(engine, path / FULL_OPTIMIZER_FILE)
    if engine.lr_scheduler is not None:
        # the elastic ZeRO restore brings back optimizer state but not the param groups' lr
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    rng_path = _rng_file(path, rank)
    if not rng_path.is_file():
        rng_path = _rng_file(path, 0)
    if rng_path.is_file():
        state = torch.load(rng_path, weights_only=True)
        state["python"] = _to_tuples(state["python"])
        restore_rng(state)
    return client or {}


def schedule_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """``key old -> new`` for each setting of the schedule that differs from the one a checkpoint
    was saved under (none for a checkpoint that recorded no schedule, nor for a key it lacks)."""
    saved = saved or {}
    return [f"{key} {saved[key]} -> {value}" for key, value in current.items() if key in saved and saved[key] != value]


def check_schedule(path: Path, saved: dict[str, Any] | None, current: dict[str, Any], allow: bool) -> list[str]:
    """Refuse, in one line, to resume ``path`` under another schedule unless ``allow``
    (``checkpoint.allow_schedule_change``); return the changes allowed."""
    changes = schedule_changes(saved, current)
    if any(change.split(" ", 1)[0] in NEVER_CHANGED for change in changes):
        raise ConfigError(f"resume: {path} was saved with another optimizer ({', '.join(changes)}); its state does "
                          "not fit this one: resume=never to start over")
    if changes and not allow:
        raise ConfigError(f"resume: {path} was saved under another schedule ({', '.join(changes)}); set "
                          "checkpoint.allow_schedule_change=true to continue under the new one, or resume=never "
                          "to start over")
    return changes


def adopt_schedule(engine, lr: float, betas, eps: float, weight_decay: float) -> None:
    """After a resume under a changed schedule: this run's AdamW settings and peak ``lr`` replace
    those the checkpoint restored, and this step's lr follows the new schedule (its shape, the
    LambdaLR's function, is this run's already: a checkpoint does not hold it)."""
    for group in engine.optimizer.param_groups:
        group.update(betas=tuple(betas), eps=eps, weight_decay=weight_decay, initial_lr=lr)
    scheduler = engine.lr_scheduler
    if scheduler is not None:
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        scheduler.last_epoch -= 1
        scheduler.step()  # recomputes the lr of the step it is at, into the groups and get_last_lr()


# -- one run per output folder ---------------------------------------------------------------


def lock_output_dir(folder: Path, rank: int) -> RunLock | None:
    """Rank 0 takes ``folder``'s lock (:class:`iga_ds.train.lock.RunLock`; returned, None on the
    other ranks); when another run holds it, every rank stops with rank 0's one line."""
    import torch.distributed as dist

    lock, refusal = None, None
    if rank == 0:
        try:
            lock = RunLock(folder).acquire()
        except UserError as exc:
            refusal = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)  # all ranks agree, as on a stop request
        refusal = shared[0]
    if refusal is not None:
        raise UserError(refusal)
    return lock


# -- stop signals ----------------------------------------------------------------------------


STOP_FILE = "STOP"  # in the output folder: a stop request that needs no signal
# a stop signal before the first step: nothing to save yet, the run ends at once
EXIT_STOPPED_IN_SETUP = 5


class SetupInterrupted(BaseException):
    """Raised by a stop signal during setup. A BaseException, as KeyboardInterrupt is, so that no
    library's ``except Exception`` around a model load swallows it; the trainer turns it into
    :meth:`as_error`."""

    def __init__(self, signum: int, phase: str):
        super().__init__(signum, phase)
        self.signum, self.phase = signum, phase

    def as_error(self) -> UserError:
        return UserError(f"stopped by {signal.Signals(self.signum).name} while {self.phase}, before the first step: "
                         "no step ran and nothing was saved (the last checkpoint, if any, is as it was); run the same "
                         "command again to continue", exit_code=EXIT_STOPPED_IN_SETUP)


class StopSignal:
    """Remembers SIGUSR1, SIGTERM and SIGINT (Ctrl-C) and watches ``stop_file``; ``requested()``
    is collective so all ranks stop together, and ``reason`` says which request it was. A second
    Ctrl-C while a stop is pending raises KeyboardInterrupt: the user wants out now.

    Installed with a ``setup_phase`` (what setup is doing, kept up to date in :attr:`phase`), a
    stop signal, SIGINT too, raises :class:`SetupInterrupted` at once instead: there is nothing to
    save before the first step, and waiting for a model load to end could take minutes.
    :meth:`training` ends that."""

    SIGNALS = tuple(s for s in (getattr(signal, "SIGUSR1", None), signal.SIGTERM, signal.SIGINT) if s is not None)

    def __init__(self, stop_file: str | Path | None = None):
        self.received: int | None = None
        self.stop_file = Path(stop_file) if stop_file is not None else None
        self.reason: str | None = None
        self.phase: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self, setup_phase: str | None = None) -> "StopSignal":
        self.phase = setup_phase
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with their old handlers
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.phase is not None:
            raise SetupInterrupted(signum, self.phase)
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def training(self) -> None:
        """Setup is done: from here a stop signal asks for a checkpoint at the next step boundary."""
        self.phase = None

    def uninstall(self) -> None:
        """The old handlers back; after a stop request, SIGUSR1 ignored instead. The process is on
        its way out then, and a repeat of the request (the job script signals the ranks just after
        writing the stop file a rank may already have acted on) would otherwise end it with the
        default action mid-exit: Python itself restores that action at shutdown."""
        usr1 = getattr(signal, "SIGUSR1", None)
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if sig == usr1 and self.reason is not None else handler)
        self._previous.clear()

    def discard_stale(self) -> bool:
        """Remove a stop file that predates this run (one rank, before any rank can look);
        True when there was one."""
        stale = self.stop_file is not None and self.stop_file.is_file()
        self.consume()
        return stale

    def consume(self) -> None:
        """Remove the stop file once the stop it asked for is done (one rank, after the
        collective check: every rank has read it by then)."""
        if self.stop_file is not None:
            self.stop_file.unlink(missing_ok=True)

    def requested(self, device=None) -> bool:
        import torch
        import torch.distributed as dist

        # [signal seen, stop file seen]: a rank whose signal never arrived, or that cannot
        # see the file, still stops with the others
        seen = torch.tensor([float(self.received is not None),
                             float(self.stop_file is not None and self.stop_file.is_file())])
        if dist.is_initialized() and dist.get_world_size() > 1:
            seen = seen.to(device)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            seen = seen.cpu()
        by_signal, by_file = (bool(x > 0) for x in seen.tolist())
        if by_signal or by_file:
            names = []
            if by_signal:
                names.append(signal.Signals(self.received).name if self.received is not None else "a signal")
            if by_file:
                names.append(f"stop file {self.stop_file.name}")
            self.reason = " and ".join(names)
        return by_signal or by_file
