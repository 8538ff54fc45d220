"""``iga-ds data merge``: the shards of a build joined into one output, checked seed by seed.

The shards ``OUT/shard-I-of-N`` must all be there (I = 0 to N-1, one N), built with the same
settings and prompts, finished (no seed pending, no tail cut off by a kill) and not being
built now; every seed of the seeds file must have exactly one outcome, in the shard its id
belongs to. Then ``OUT`` gets what an unsharded build would have written: ``isomers.jsonl``
and ``dropped.jsonl`` in the seeds file's order, ``stats.json``, and last ``build.json``, each
file written whole or not at all. ``build.json`` marks a finished merge: until it is written
(again) the folder is a merge cut off, which a build refuses and the next merge finishes. A
merged ``OUT`` resumes as an unsharded build would (nothing to do).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict
from pathlib import Path

from iga_ds.data.teacher.pipeline import (DROPPED_FILE, KEPT_FILE, SETTINGS_FILE, STATS_FILE, BuildSettings,
                                          Outcomes, compute_stats, hold_output_dir, read_outcomes, read_seeds,
                                          repair_point)
from iga_ds.data.teacher.shards import SHARD_DIR, shard_of
from iga_ds.errors import DataError, UserError
from iga_ds.files import atomic_write_json, read_json, write_jsonl


def find_shards(out: Path) -> tuple[int, list[Path]]:
    """N and the folders of shards 0 to N-1 under ``out``; a UserError if any is missing."""
    found: dict[int, dict[int, Path]] = {}
    for path in sorted(out.iterdir()) if out.is_dir() else []:
        match = SHARD_DIR.match(path.name)
        if match and path.is_dir():
            found.setdefault(int(match[2]), {})[int(match[1])] = path
    if not found:
        raise UserError(f"--out {out}: no shard-I-of-N folders to merge (a build with --shard I/N --out {out} "
                        "writes them)")
    if len(found) > 1:
        raise UserError(f"--out {out}: shards of {' and '.join(str(n) for n in sorted(found))} builds side by side; "
                        "move the folders of the stale split away")
    count, shards = next(iter(found.items()))
    missing = [i for i in range(count) if i not in shards]
    if missing or len(shards) != count:
        raise UserError(f"--out {out}: shard {', '.join(map(str, missing))} of {count} missing (no "
                        f"shard-{missing[0]}-of-{count}): build it with --shard {missing[0]}/{count}")
    return count, [shards[i] for i in range(count)]


def _settings(path: Path, index: int, count: int) -> dict:
    """The shard's build settings, checked to be those of shard ``index`` of ``count``."""
    stored = read_json(path / SETTINGS_FILE, objects=True)
    settings = {**asdict(BuildSettings()), **stored}
    if settings["shard"] != f"{index}/{count}":
        raise DataError(f"{path / SETTINGS_FILE}: field 'shard' is {settings['shard']!r}, expected "
                        f"'{index}/{count}' for this folder")
    return settings


def _same_settings(shards: list[Path], count: int) -> dict:
    """The settings every shard was built with (their ``shard`` field aside)."""
    first = _settings(shards[0], 0, count)
    for index, path in enumerate(shards[1:], 1):
        other = _settings(path, index, count)
        for key, value in first.items():
            if key != "shard" and other.get(key) != value:
                raise DataError(f"{path / SETTINGS_FILE}: {key}={other.get(key)!r}, but shard 0 was built with "
                                f"{value!r}: shards built with other settings or prompts cannot be merged")
    return {**first, "shard": ""}


def _finished_tail(path: Path, index: int, count: int, domains: int) -> None:
    """Refuse a shard whose files end in a line or group cut off by a kill."""
    for name, group in ((KEPT_FILE, domains), (DROPPED_FILE, None)):
        file = path / name
        if file.exists():
            data = file.read_bytes()
            if repair_point(data, group, file) != len(data):
                raise UserError(f"{file}: ends in a record cut off by a kill: run the build of shard "
                                f"{index}/{count} again to finish it, then merge")


def _shard_outcomes(path: Path, index: int, count: int, seed_ids: set[str], seeds_path) -> Outcomes:
    outcomes = read_outcomes(path)
    if outcomes.repeated:
        raise DataError(f"{path}: seed {outcomes.repeated[0]!r} is recorded twice: run the build of shard "
                        f"{index}/{count} again (it removes repeats), then merge")
    for sid in outcomes.finished():
        if sid not in seed_ids:
            raise DataError(f"{path}: seed {sid!r} is not in {seeds_path}: merge with the seeds file the "
                            "shards were built from")
        if shard_of(sid, count) != index:
            raise DataError(f"{path}: seed {sid!r} belongs to shard {shard_of(sid, count)}/{count}, not "
                            f"{index}/{count}: the folder was copied from another build?")
    return outcomes


def merge_shards(seeds_path: str | Path, out_dir: str | Path) -> dict:
    """Check the shards under ``out_dir`` and write the merged output there; return its stats."""
    seeds = read_seeds(seeds_path)
    out = Path(out_dir)
    count, shards = find_shards(out)
    if (out / SETTINGS_FILE).exists() and "merged_shards" not in read_json(out / SETTINGS_FILE, objects=True):
        raise UserError(f"--out {out}: holds a build of its own ({SETTINGS_FILE}); merge the shards elsewhere")
    with contextlib.ExitStack() as held:
        for path in [out, *shards]:
            held.enter_context(hold_output_dir(path))  # no build may write while this reads
        settings = _same_settings(shards, count)
        ids = [s["seed_id"] for s in seeds]
        kept, dropped, pending = {}, {}, {}
        for index, path in enumerate(shards):
            _finished_tail(path, index, count, len(settings["domains"]))
            outcomes = _shard_outcomes(path, index, count, set(ids), seeds_path)
            kept.update(outcomes.kept)
            dropped.update(outcomes.dropped)
        for sid in ids:
            if sid not in kept and sid not in dropped:
                pending[shard_of(sid, count)] = pending.get(shard_of(sid, count), 0) + 1
        if pending:
            where = ", ".join(f"shard {i}/{count}: {n}" for i, n in sorted(pending.items()))
            raise UserError(f"{sum(pending.values())} of {len(ids)} seeds have no outcome yet ({where}): "
                            "run those shards' builds again, then merge")
        # build.json is what says the merge finished: an earlier merge's goes first, the new one
        # last, so a merge killed between its writes leaves none (a build refuses such a folder,
        # and merging again finishes it)
        (out / SETTINGS_FILE).unlink(missing_ok=True)
        write_jsonl(out / DROPPED_FILE, [dropped[sid] for sid in ids if sid in dropped])
        write_jsonl(out / KEPT_FILE, [r for sid in ids if sid in kept for r in kept[sid]])
        stats = {**compute_stats(out, ids, structure_check=settings["structure_check"]), "merged_shards": count}
        atomic_write_json(out / STATS_FILE, stats)
        atomic_write_json(out / SETTINGS_FILE, {**settings, "merged_shards": count})
    return stats
