"""Build Logical Isomer Sets from seed problems with a teacher LLM, resumably.

Per seed (paper section 3.3 and appendix "Quality Filtering"):

1. DAG extraction (prompt 1); a reply that is not a typed DAG is regenerated;
2. instantiation in each domain (prompt 2), then quality verification against the seed
   (prompt 3); an instance whose structural alignment score is below ``min_score`` (0.85)
   is regenerated;
3. the group filter (``filters``): CoT step counts within ``max_step_diff`` (2) of each
   other, each solution's steps following the DAG's dependencies, one answer type; a group
   that fails is dropped, as in the paper (``outliers="regenerate"``: its outlying instance
   is regenerated instead, a departure from the paper);
4. each instance (and the DAG) may be regenerated up to ``max_regenerations`` times; then
   the group is dropped with a reason.

Output in ``out_dir``: ``isomers.jsonl`` (kept groups, schema of ``iga_ds.data.schema``),
``dropped.jsonl`` (one line per dropped seed with its reason), ``stats.json`` (retention;
the paper keeps 78%) and ``build.json`` (the settings, checked on resume).

Every seed ends exactly once, kept or dropped, whatever the moment of a kill. Outcomes are
written by one thread, each seed's in one ``write``, fsync'd; one build at a time holds the
output directory (a lock the kernel drops when the process dies). On start, a torn tail left
by a kill (a cut line, or the first lines of a group) is cut off, and seeds already in either
file are skipped; counts are of distinct seeds of the seeds file, so they never go negative.

Seeds whose requests failed after all retries, or that the server refused before any seed of
the run got through, are in neither file and are tried again by the next run. Seeds that fail
or are refused several times in a row stop the build (a setup mistake would repeat for every
seed) and nothing more is started; a stopped or interrupted build abandons its requests in
flight instead of waiting for them.

A teacher that does not name the uses/derives nodes of its steps (the paper's own format) fails
the default structure check on every group. The build notices: seeds dropped as
``structure_unannotated`` are held back until some seed passes the structure check or fails it
otherwise; when the first ``stop_unannotated`` (8) seeds of a fresh build that reach the check
all fail it unannotated, the build stops, drops none of them, and names ``--structure-check
verdict`` (the teacher's verification verdict, as the paper filters). A build whose folder
records no group judged by the structure check yet may switch the check on resume.
"""
from __future__ import annotations

import json
import queue
import re
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from iga_ds.data.domains import DEFAULT_DOMAINS
from iga_ds.data.teacher.clients import ChatClient, Counters, TeacherError, TeacherRejected
from iga_ds.data.teacher.filters import STRUCTURE_CHECKS, UNANNOTATED, check_group, check_reason, reached_check
from iga_ds.data.teacher.parse import Instance, MalformedOutput, parse_dag, parse_instance, parse_verification
from iga_ds.data.teacher.prompts import Prompts, Template
from iga_ds.data.teacher.shards import SHARD_DIR, in_shard, parse_shard, shard_dir
from iga_ds.errors import DataError, UserError
from iga_ds.files import (FolderLock, append_lines, atomic_write_json, cut_torn_tail, iter_jsonl, jsonl_text,
                          make_dir, torn_tail_start, write_jsonl)
from iga_ds.progress import progress as progress_of

KEPT_FILE, DROPPED_FILE, STATS_FILE, SETTINGS_FILE = "isomers.jsonl", "dropped.jsonl", "stats.json", "build.json"
LOCK_FILE = ".build.lock"
PAPER_RETENTION = 0.78
# seeds in a row whose requests failed after all retries, or were refused, stop the build
STOP_AFTER = 3
# the first seeds of a build to reach the structure check that, all unannotated, stop it
STOP_UNANNOTATED = 8
# settings a resumed build may change while its folder records no group they judged
SWITCHABLE = ("structure_check",)


@dataclass
class BuildSettings:
    """What decides the content of the output; a resumed build must use the same."""

    domains: list[str] = field(default_factory=lambda: list(DEFAULT_DOMAINS))
    min_score: float = 0.85
    max_step_diff: int = 2
    max_regenerations: int = 3
    teacher: str = "openai"
    model: str = ""
    templates_sha256: str = ""
    shard: str = ""  # "I/N" for shard I of N; "" for the whole seeds file
    outliers: str = "discard"  # a group failing the filter: "discard" (the paper) or "regenerate"
    # the solutions' dependency structure: "dag" (each step's uses/derives against the DAG) or
    # "verdict" (the teacher's verification verdict, as the paper; for teachers that do not annotate)
    structure_check: str = "dag"


def read_seeds(path: str | Path) -> list[dict]:
    """Seed problems: JSON Lines with ``seed_id`` (or ``id``) and ``problem``."""
    seeds, seen = [], {}
    for lineno, obj in iter_jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object with 'seed_id' and 'problem'")
        sid = obj.get("seed_id", obj.get("id"))
        if isinstance(sid, int) and not isinstance(sid, bool):
            sid = str(sid)
        if not isinstance(sid, str) or not sid.strip():
            raise DataError(f"{where}: field 'seed_id' missing or not a string (an 'id' field also works)")
        problem = obj.get("problem")
        if not isinstance(problem, str) or not problem.strip():
            raise DataError(f"{where}: field 'problem' missing or empty")
        if sid in seen:
            raise DataError(f"{where}: field 'seed_id': {sid!r} already used on line {seen[sid]}")
        seen[sid] = lineno
        seeds.append({"seed_id": sid, "problem": problem})
    if not seeds:
        raise DataError(f"{path}: no seed problems")
    return seeds


@dataclass
class GroupOutcome:
    seed_id: str
    records: list[dict] | None = None  # kept
    reason: str | None = None  # dropped
    regenerations: int = 0
    malformed: int = 0


class _Drop(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class SeedAbandoned(Exception):
    """The build is stopping: a seed is left before its next request (it stays to do)."""


def asks_for_json(template: Template) -> bool:
    """Whether a prompt's own text (not what fills its placeholders) asks for a JSON reply."""
    text = re.sub(r"\{[a-z_]+\}", " ", template.system + "\n" + template.user)
    return "json" in text.lower()


class SeedProcessor:
    """Runs the three prompts and the filters for one seed; thread-safe (stateless)."""

    def __init__(self, client: ChatClient, prompts: Prompts, settings: BuildSettings,
                 counters: Counters, stop: threading.Event | None = None):
        self.client, self.prompts, self.settings, self.counters = client, prompts, settings, counters
        self.stop = stop or threading.Event()
        self.json_reply = {name: asks_for_json(t) for name, t in prompts.templates.items()}

    def __call__(self, seed: dict) -> GroupOutcome:
        """The seed's kept group or drop reason. A request that fails for good raises
        (TeacherError, TeacherRejected, UserError), and so does a stop (SeedAbandoned)."""
        outcome = GroupOutcome(seed["seed_id"])
        try:
            outcome.records = self._build(seed, outcome)
        except _Drop as drop:
            outcome.reason = drop.reason
        return outcome

    def _ask(self, template: str, messages: list[dict]) -> str:
        """The teacher's reply to one prompt, in JSON mode where the prompt asks for JSON."""
        if self.stop.is_set():
            raise SeedAbandoned()
        return self.client.chat(messages, json_reply=self.json_reply.get(template, False))

    def _regenerate(self, outcome: GroupOutcome, used: dict, key: str, reason: str) -> None:
        if used.get(key, 0) >= self.settings.max_regenerations:
            raise _Drop(reason)
        used[key] = used.get(key, 0) + 1
        outcome.regenerations += 1
        self.counters.add("regenerations")

    def _malformed(self, outcome: GroupOutcome) -> None:
        outcome.malformed += 1
        self.counters.add("malformed")

    def _build(self, seed: dict, outcome: GroupOutcome) -> list[dict]:
        s = self.settings
        used: dict[str, int] = {}
        while True:
            try:
                dag = parse_dag(self._ask("dag_extraction", self.prompts.dag_extraction(seed["problem"])))
                break
            except MalformedOutput:
                self._malformed(outcome)
                self._regenerate(outcome, used, "dag", "dag_malformed")

        accepted: dict[str, tuple[Instance, object]] = {}
        pending = list(s.domains)
        while True:
            for domain in pending:
                accepted[domain] = self._instance(seed, dag, domain, outcome, used)
            pending = self._filter_outliers(accepted, dag, outcome, used)
            if not pending:
                break

        group_id = seed["seed_id"]
        records = []
        for domain in s.domains:
            inst, ver = accepted[domain]
            records.append({
                "group_id": group_id,
                "seed_id": seed["seed_id"],
                "domain": domain,
                "problem": inst.problem,
                "cot": inst.cot_text(),
                "answer": inst.answer,
                "dag": dag,
                "alignment_score": ver.score,
                "meta": {"teacher_model": s.model, "verdict": ver.verdict,
                         "self_score": inst.self_score, "step_count": inst.step_count,
                         "regenerations": used.get(domain, 0), "structure_check": s.structure_check},
            })
        return records

    def _instance(self, seed: dict, dag: dict, domain: str, outcome: GroupOutcome, used: dict):
        """Instantiate and verify one domain until it passes or its budget is spent."""
        s = self.settings
        while True:
            try:
                inst = parse_instance(self._ask("domain_instantiation",
                                                self.prompts.domain_instantiation(dag, domain)))
            except MalformedOutput:
                self._malformed(outcome)
                self._regenerate(outcome, used, domain, f"instance_malformed ({domain})")
                continue
            try:
                ver = parse_verification(self._ask("quality_verification", self.prompts.quality_verification(
                    seed["problem"], inst.problem, dag, s.min_score)))
            except MalformedOutput:
                self._malformed(outcome)
                self._regenerate(outcome, used, domain, f"verification_malformed ({domain})")
                continue
            if ver.score >= s.min_score:
                return inst, ver
            self._regenerate(outcome, used, domain, f"low_score ({domain})")

    def _filter_outliers(self, accepted: dict, dag: dict, outcome: GroupOutcome, used: dict) -> list[str]:
        """[] if the group passes the filter; else drop it (the paper), or name the domain to regenerate."""
        s = self.settings
        failure = check_group({d: accepted[d][0] for d in s.domains}, dag, s.max_step_diff, s.structure_check,
                              {d: accepted[d][1].verdict for d in s.domains})
        if failure is None:
            return []
        if s.outliers != "regenerate":
            raise _Drop(failure.reason)
        self._regenerate(outcome, used, failure.domain, failure.reason)
        return [failure.domain]


def repair_point(data: bytes, complete_group: int | None = None, path: Path | None = None) -> int:
    """Where the whole lines (with ``complete_group``, the whole groups) of an output file end;
    what lies past that point was being written when the build was killed."""
    end = torn_tail_start(data)
    if complete_group is None or not end:
        return end
    # a group is written in one write(): only the last group can be short
    last_gid, tail_start, tail_count, offset = None, 0, 0, 0
    for line in data[:end].splitlines(keepends=True):
        try:
            gid = json.loads(line)["group_id"]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path}: unreadable line at byte {offset}; the file was edited "
                            "by hand? Move it away to rebuild") from None
        if gid != last_gid:
            last_gid, tail_start, tail_count = gid, offset, 0
        tail_count += 1
        offset += len(line)
    return tail_start if tail_count < complete_group else end


def _repair_tail(path: Path, complete_group: int | None = None) -> None:
    """Cut a torn last line (and, for the kept file, a torn last group) left by a kill."""
    if path.exists():
        cut_torn_tail(path, keep=repair_point(path.read_bytes(), complete_group, path))


@dataclass
class Outcomes:
    """What an output directory records, by seed: the first kept group, the first drop record,
    and the seeds recorded again after that (which :func:`_drop_repeats` removes)."""

    kept: dict[str, list[dict]] = field(default_factory=dict)
    dropped: dict[str, dict] = field(default_factory=dict)
    repeated: list[str] = field(default_factory=list)

    def finished(self) -> set[str]:
        return set(self.kept) | set(self.dropped)


def _seed_of(rec: dict, path: Path, lineno: int, fields: tuple[str, ...]) -> str:
    for name in fields:
        if not isinstance(rec.get(name), str):
            raise DataError(f"{path}:{lineno}: field {name!r} missing or not a string")
    return rec["seed_id"]


def read_outcomes(out: str | Path) -> Outcomes:
    """The outcomes recorded in ``out`` (kept groups are runs of lines of one group_id)."""
    out, found = Path(out), Outcomes()
    if (out / KEPT_FILE).exists():
        group, seed = None, None
        for lineno, rec in iter_jsonl(out / KEPT_FILE):
            sid = _seed_of(rec, out / KEPT_FILE, lineno, ("seed_id", "group_id"))
            if rec["group_id"] != group or sid != seed:
                group, seed = rec["group_id"], sid
                if sid in found.kept:
                    found.repeated.append(sid)
                    seed = None  # the lines of a repeated group are not kept
                    continue
                found.kept[sid] = []
            if seed is not None:
                found.kept[sid].append(rec)
    if (out / DROPPED_FILE).exists():
        for lineno, rec in iter_jsonl(out / DROPPED_FILE):
            sid = _seed_of(rec, out / DROPPED_FILE, lineno, ("seed_id", "reason"))
            if sid in found.kept or sid in found.dropped:
                found.repeated.append(sid)
            else:
                found.dropped[sid] = rec
    return found


def _drop_repeats(out: Path, outcomes: Outcomes) -> None:
    """Rewrite the outputs with one outcome per seed (a kept group wins over a drop record).
    Builds of this version never repeat a seed; an earlier version's resume, or two builds
    at once before the directory lock, could."""
    if not outcomes.repeated:
        return
    write_jsonl(out / KEPT_FILE, [r for records in outcomes.kept.values() for r in records])
    write_jsonl(out / DROPPED_FILE, list(outcomes.dropped.values()))
    outcomes.repeated = []


class hold_output_dir(FolderLock):
    """One build (or merge) at a time in an output directory (:class:`iga_ds.files.FolderLock`)."""

    def __init__(self, out: Path):
        super().__init__(out, LOCK_FILE, lambda folder, holder: (
            f"{folder}: another build ({holder}) is writing here; wait for it to end or stop it"))


def reached_structure_check(outcomes: Outcomes) -> bool:
    """Whether any recorded group went through the structure check (kept, or dropped by it or after it)."""
    return bool(outcomes.kept) or any(reached_check(rec["reason"]) for rec in outcomes.dropped.values())


def structure_check_counts(outcomes: Outcomes, seed_ids: set[str]) -> dict[str, dict[str, int]]:
    """check -> the groups of ``seed_ids`` it let through that are kept, and those it dropped.
    A kept group names its check in ``meta.structure_check`` (none: ``dag``, the only one before)."""
    counts: dict[str, Counter] = {}
    for sid, records in outcomes.kept.items():
        if sid in seed_ids and records:
            meta = records[0].get("meta") if isinstance(records[0].get("meta"), dict) else {}
            counts.setdefault(meta.get("structure_check", "dag"), Counter())["kept"] += 1
    for sid, rec in outcomes.dropped.items():
        check = check_reason(rec["reason"]) if sid in seed_ids else None
        if check is not None:
            counts.setdefault(check, Counter())["dropped"] += 1
    return {check: {"kept": c["kept"], "dropped": c["dropped"]} for check, c in sorted(counts.items())}


def _check_settings(out: Path, settings: BuildSettings) -> None:
    path = out / SETTINGS_FILE
    wanted = asdict(settings)
    if path.exists():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            raise DataError(f"{path}: not valid JSON; move the output directory away to rebuild") from None
        defaults = asdict(BuildSettings())  # a field added since: its default is what was used
        switched = False
        for key, value in wanted.items():
            if stored.get(key, defaults[key]) == value:
                continue
            if key in SWITCHABLE and not reached_structure_check(read_outcomes(out)):
                switched = True  # no recorded group depends on it
                continue
            raise UserError(f"{out} was built with {key}={stored.get(key, defaults[key])!r}, this run has "
                            f"{value!r}: resume with the same arguments or use another --out")
        if switched:
            atomic_write_json(path, {**stored, **wanted})
    else:
        atomic_write_json(path, wanted)


def compute_stats(out: Path, seed_ids: list[str], this_run: dict | None = None, structure_check: str = "dag") -> dict:
    """Counts of distinct seeds of the seeds file: kept + dropped + pending == seeds."""
    outcomes = read_outcomes(out)
    wanted = set(seed_ids)
    kept = [sid for sid in outcomes.kept if sid in wanted]
    dropped = [sid for sid in outcomes.dropped if sid in wanted]
    scores = [r["alignment_score"] for sid in kept for r in outcomes.kept[sid] if r.get("alignment_score") is not None]
    reasons = Counter(outcomes.dropped[sid]["reason"].split(" (")[0] for sid in dropped)
    finished = len(kept) + len(dropped)
    this_run = dict(this_run or {})
    return {
        "seeds": len(wanted),
        "kept_groups": len(kept),
        "kept_instances": sum(len(outcomes.kept[sid]) for sid in kept),
        "dropped_groups": len(dropped),
        "pending_seeds": len(wanted) - finished,
        "recorded_not_in_seeds": len(outcomes.finished() - wanted),
        "failed_this_run": this_run.get("failed", 0),
        "refused_this_run": this_run.get("refused", 0),
        "last_error": this_run.pop("last_error", None),
        "retention": len(kept) / finished if finished else None,
        "paper_retention": PAPER_RETENTION,
        "drop_reasons": dict(sorted(reasons.items())),
        "mean_alignment_score": sum(scores) / len(scores) if scores else None,
        "structure_check": structure_check,
        "structure_check_groups": structure_check_counts(outcomes, wanted),
        "this_run": dict(sorted(this_run.items())),
    }


class _Recorder:
    """Appends each finished seed to the kept or dropped file and tallies the run for the bar.
    Called from the main thread only: one writer, one ``write`` per seed."""

    def __init__(self, out: Path, counters: Counters, bar=None):
        self.out, self.counters, self.bar = out, counters, bar
        self.tally: Counter = Counter()  # kept, dropped, failed, refused, abandoned (this run)

    def __call__(self, outcome: GroupOutcome) -> None:
        """Append the kept group, or the drop reason, of one finished seed."""
        if outcome.records is not None:
            append_lines(self.out / KEPT_FILE, [jsonl_text(outcome.records)])
            self.tally["kept"] += 1
        else:
            append_lines(self.out / DROPPED_FILE, [jsonl_text([
                {"seed_id": outcome.seed_id, "reason": outcome.reason,
                 "regenerations": outcome.regenerations, "malformed": outcome.malformed}])])
            self.tally["dropped"] += 1
        self._show()

    def _show(self) -> None:
        """Advance the progress bar, if any, by one seed and refresh its counts."""
        if self.bar is None:
            return
        self.bar.update(1)
        self.bar.set_postfix(kept=self.tally["kept"], dropped=self.tally["dropped"],
                             retried=self.counters.get("http_retries") + self.counters.get("regenerations"),
                             failed=self.tally["failed"] + self.tally["refused"], refresh=False)

    def close(self) -> None:
        """Close the progress bar, if any."""
        if self.bar is not None:
            self.bar.close()


class _AnnotationWatch:
    """Whether the teacher annotates its steps, told by the first seeds to reach the structure check.

    Seeds dropped as structure_unannotated are held back (not recorded) while the watch is open.
    A seed that passes the check, or fails it otherwise, closes it: the held seeds are recorded
    as the drops they are. When ``window`` seeds are held (or the run ends with some held and
    none other through the check), the watch trips: the held seeds stay to do, the build stops.
    """

    def __init__(self, window: int):
        self.window, self.open = window, window > 0
        self.held: list[GroupOutcome] = []

    def admit(self, outcome: GroupOutcome) -> list[GroupOutcome]:
        """The outcomes to record now (none while ``outcome`` is held back)."""
        if not self.open or not reached_check(outcome.reason):
            return [outcome]
        if outcome.reason is not None and outcome.reason.split(" (")[0] == UNANNOTATED:
            self.held.append(outcome)
            return []
        self.open = False
        ready, self.held = [*self.held, outcome], []
        return ready

    def tripped(self, ended: bool = False) -> bool:
        return self.open and bool(self.held) and (ended or len(self.held) >= self.window)

    def error(self) -> UserError:
        return UserError(f"stopped: the first {len(self.held)} seeds to reach the structure check all failed as "
                         f"{UNANNOTATED}: the teacher does not name the uses/derives nodes of its steps; nothing "
                         "was dropped: run again with --structure-check verdict to filter on the teacher's "
                         "verification verdict instead, as the paper does")


class _Run:
    """What this run does with each seed's result: record it, hold it back, or stop the build.

    A refused request (a 4xx) is the seed's own fault only if other seeds get through: until
    one does, refused seeds are held back, not dropped, so that a setup mistake (a wrong model
    name, a too-large --max-tokens) drops nothing. STOP_AFTER seeds in a row that fail or are
    refused stop the build with the last cause. Seeds dropped as unannotated go through the
    watch (:class:`_AnnotationWatch`), which may hold them back and stop the build.
    """

    def __init__(self, recorder: _Recorder, watch: _AnnotationWatch | None = None):
        self.recorder, self.tally = recorder, recorder.tally
        self.watch = watch or _AnnotationWatch(0)
        self.streak, self.got_through = 0, False
        self.held: list[tuple[str, TeacherRejected]] = []
        self.last_error: str | None = None
        self.stop: UserError | None = None

    def take(self, seed_id: str, result) -> None:
        if isinstance(result, GroupOutcome):
            for outcome in self.watch.admit(result):
                self.recorder(outcome)
            self.streak, self.got_through = 0, True
            self._drop_held()
            if self.watch.tripped() and self.stop is None:
                self.stop = self.watch.error()
        elif isinstance(result, SeedAbandoned):
            self.tally["abandoned"] += 1
        elif isinstance(result, TeacherError):  # a refusal (TeacherRejected) or retries spent
            self._failed(seed_id, result)
        elif isinstance(result, UserError):  # 401/403/404: the setup is wrong
            self.stop = self.stop or result
        else:
            raise result  # a bug: keep its traceback

    def _failed(self, seed_id: str, exc: TeacherError) -> None:
        self.streak += 1
        self.last_error = str(exc)
        if isinstance(exc, TeacherRejected):
            self.held.append((seed_id, exc))
        else:
            self.tally["failed"] += 1
        if self.streak >= STOP_AFTER and self.stop is None:
            if isinstance(exc, TeacherRejected):
                self.stop = UserError(f"stopped: {self.streak} seeds in a row were refused by the teacher server "
                                      f"({exc}); nothing was dropped: fix the request and run the same command again")
            else:
                self.stop = UserError(f"stopped: {self.streak} seeds in a row failed ({exc}); nothing was dropped: "
                                      "run the same command again once the server answers", exit_code=1)

    def _drop_held(self) -> None:
        """Refusals of seeds while others got through were the seeds' own: record them as drops."""
        for seed_id, exc in self.held:
            self.recorder(GroupOutcome(seed_id, reason=f"request_rejected ({exc})"))
        self.held.clear()

    def finish(self, abandoned: int) -> None:
        """Settle the held refusals: drops if the run was not stopped and some seed got through."""
        if self.stop is None and self.got_through:
            self._drop_held()
        if self.stop is None and self.watch.tripped(ended=True):
            self.stop = self.watch.error()
        if self.watch.held:
            self.tally["held_unannotated"] += len(self.watch.held)
        self.tally["refused"] += len(self.held)
        self.tally["abandoned"] += abandoned
        self.held.clear()

    def summary(self, counters: Counters) -> dict:
        return {**counters.values, **self.tally, "last_error": self.last_error}


class _Workers:
    """Daemon threads that run the processor on submitted seeds and hand back the results.

    Daemon threads, so that a stopped or interrupted build returns at once: a request in flight
    is abandoned, not waited for, and its seed stays to do.
    """

    def __init__(self, processor: SeedProcessor, concurrency: int):
        self.processor, self.concurrency = processor, concurrency
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(concurrency):
            threading.Thread(target=self._work, name=f"teacher-{i}", daemon=True).start()

    def _work(self) -> None:
        while True:
            seed = self._tasks.get()
            if seed is None:
                return
            try:
                result = self.processor(seed)
            except Exception as exc:  # noqa: BLE001 (the main thread decides what it means)
                result = exc
            self._results.put((seed["seed_id"], result))

    def submit(self, seed: dict) -> None:
        self._tasks.put(seed)

    def next_result(self) -> tuple[str, object]:
        while True:
            try:
                return self._results.get(timeout=1.0)  # wakes up for Ctrl-C on any platform
            except queue.Empty:
                continue

    def close(self) -> None:
        for _ in range(self.concurrency):
            self._tasks.put(None)


def _check_not_a_cut_off_merge(out: Path) -> None:
    """Refuse a folder where ``iga-ds data merge`` was killed: it writes ``build.json`` last,
    while a build writes it before any outcome."""
    if (out / SETTINGS_FILE).exists():
        return
    written = [name for name in (KEPT_FILE, DROPPED_FILE, STATS_FILE) if (out / name).exists()]
    if written and any(SHARD_DIR.match(path.name) and path.is_dir() for path in out.iterdir()):
        raise UserError(f"--out {out}: holds a merge of shards that did not finish ({', '.join(written)} but "
                        f"no {SETTINGS_FILE}, which the merge writes last): run `iga-ds data merge` with the "
                        "same --seeds and --out again to finish it")


def _seeds_to_do(out: Path, seeds: list[dict], settings: BuildSettings) -> tuple[list[dict], Outcomes]:
    """Prepare ``out`` for a new or resumed build; return the seeds in neither output file, and
    what the folder records."""
    _check_not_a_cut_off_merge(out)
    _check_settings(out, settings)
    _repair_tail(out / KEPT_FILE, complete_group=len(settings.domains))
    _repair_tail(out / DROPPED_FILE)
    outcomes = read_outcomes(out)
    _drop_repeats(out, outcomes)
    done = outcomes.finished()
    return [s for s in seeds if s["seed_id"] not in done], outcomes


def _process_seeds(todo: list[dict], processor: SeedProcessor, run: _Run, concurrency: int) -> None:
    """Run ``processor`` on ``todo`` in ``concurrency`` threads, a bounded number of seeds
    ahead; ``run`` takes each result in this thread as it comes. On a stop or an interrupt
    nothing more starts and the seeds in flight are abandoned (they stay to do)."""
    workers = _Workers(processor, concurrency)
    seeds, in_flight = iter(todo), 0
    try:
        while True:
            while in_flight < 2 * concurrency and run.stop is None:
                seed = next(seeds, None)
                if seed is None:
                    break
                workers.submit(seed)
                in_flight += 1
            if in_flight == 0 or run.stop is not None:
                break
            seed_id, result = workers.next_result()
            in_flight -= 1
            run.take(seed_id, result)
    finally:
        processor.stop.set()  # seeds still running end before their next request
        workers.close()
    run.finish(abandoned=in_flight)


def _progress_bar(progress: bool, total: int, done: int):
    if not progress:
        return None
    return progress_of(total, "build", "seed", initial=done)


def build(seeds_path: str | Path, out_dir: str | Path, client: ChatClient, settings: BuildSettings,
          prompts: Prompts | None = None, concurrency: int = 4, counters: Counters | None = None,
          progress: bool = True, shard: str | None = None, stop_unannotated: int = STOP_UNANNOTATED) -> dict:
    """Run (or resume) the pipeline; return the stats also written to ``stats.json``.

    ``shard="I/N"`` builds only shard I of N of the seeds, in ``out_dir/shard-I-of-N``.
    ``stop_unannotated``: the number of first seeds to reach the structure check that, all
    failing it as structure_unannotated, stop the build (0: never; module docstring).
    Raises the UserError that stopped the build, after writing the stats.
    """
    if concurrency < 1:
        raise UserError(f"--concurrency {concurrency}: expected at least 1")
    if stop_unannotated < 0:
        raise UserError(f"--stop-unannotated {stop_unannotated}: expected a number >= 0 (0: never stop)")
    if settings.structure_check not in STRUCTURE_CHECKS:
        raise UserError(f"--structure-check {settings.structure_check!r}: expected one of {', '.join(STRUCTURE_CHECKS)}")
    seeds = read_seeds(seeds_path)
    out = Path(out_dir)
    if shard:
        index, count = parse_shard(shard)
        seeds, settings.shard, out = in_shard(seeds, index, count), f"{index}/{count}", shard_dir(out, index, count)
    prompts = prompts or Prompts()
    if not settings.templates_sha256:
        settings.templates_sha256 = prompts.fingerprint()
    counters = counters or getattr(client, "counters", None) or Counters()
    make_dir(out)
    with hold_output_dir(out):
        todo, recorded = _seeds_to_do(out, seeds, settings)
        recorder = _Recorder(out, counters, _progress_bar(progress, len(seeds), len(seeds) - len(todo)))
        # only a build with no group through the check yet watches (a resume would hold back
        # the unannotated drops of a teacher already known to annotate some steps)
        fresh = settings.structure_check == "dag" and not reached_structure_check(recorded)
        run = _Run(recorder, _AnnotationWatch(stop_unannotated if fresh else 0))
        try:
            _process_seeds(todo, SeedProcessor(client, prompts, settings, counters), run, concurrency)
        finally:
            recorder.close()
            # written after a stop or an interrupt too: the stats count what is recorded
            stats = compute_stats(out, [s["seed_id"] for s in seeds], run.summary(counters), settings.structure_check)
            atomic_write_json(out / STATS_FILE, stats)
    if run.stop is not None:
        raise run.stop
    return stats
