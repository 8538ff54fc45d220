"""Build Logical Isomer Sets from seed problems with a teacher LLM, resumably.

Per seed (paper section 3.3 and appendix "Quality Filtering"):

1. DAG extraction (prompt 1); a reply that is not a typed DAG is regenerated;
2. instantiation in each domain (prompt 2), then quality verification against the seed
   (prompt 3); an instance whose structural alignment score is below ``min_score`` (0.85)
   is regenerated;
3. the group's CoT step counts must lie within ``max_step_diff`` (2) of each other, and its
   answers must have one type; otherwise the outlying instance is regenerated;
4. each instance (and the DAG) may be regenerated up to ``max_regenerations`` times; then
   the group is dropped with a reason.

Output in ``out_dir``: ``isomers.jsonl`` (kept groups, schema of ``iga_ds.data.schema``),
``dropped.jsonl`` (one line per dropped seed with its reason), ``stats.json`` (retention;
the paper keeps 78%) and ``build.json`` (the settings, checked on resume). Each finished group
is appended with one ``write`` and fsync'd; on start, a torn tail left by a kill is cut off,
and seeds already in either file are skipped, so a killed build restarted with the same
arguments loses and duplicates nothing. Seeds whose requests failed after all retries are in
neither file and are retried by the next run.
"""
from __future__ import annotations

import json
import statistics
import threading
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from iga_ds.data.domains import DEFAULT_DOMAINS
from iga_ds.data.schema import answer_type
from iga_ds.data.teacher.clients import ChatClient, Counters, TeacherError, TeacherRejected
from iga_ds.data.teacher.parse import Instance, MalformedOutput, parse_dag, parse_instance, parse_verification
from iga_ds.data.teacher.prompts import Prompts
from iga_ds.errors import DataError, UserError
from iga_ds.files import append_lines, atomic_write_json, cut_torn_tail, iter_jsonl, make_dir, torn_tail_start

KEPT_FILE, DROPPED_FILE, STATS_FILE, SETTINGS_FILE = "isomers.jsonl", "dropped.jsonl", "stats.json", "build.json"
PAPER_RETENTION = 0.78


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


class SeedProcessor:
    """Runs the three prompts and the filters for one seed; thread-safe (stateless)."""

    def __init__(self, client: ChatClient, prompts: Prompts, settings: BuildSettings,
                 counters: Counters):
        self.client, self.prompts, self.settings, self.counters = client, prompts, settings, counters

    def __call__(self, seed: dict) -> GroupOutcome:
        outcome = GroupOutcome(seed["seed_id"])
        try:
            outcome.records = self._build(seed, outcome)
        except _Drop as drop:
            outcome.reason = drop.reason
        except TeacherRejected as exc:
            outcome.reason = f"request_rejected ({exc})"
        return outcome

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
                dag = parse_dag(self.client.chat(self.prompts.dag_extraction(seed["problem"])))
                break
            except MalformedOutput:
                self._malformed(outcome)
                self._regenerate(outcome, used, "dag", "dag_malformed")

        accepted: dict[str, tuple[Instance, object]] = {}
        pending = list(s.domains)
        while True:
            for domain in pending:
                accepted[domain] = self._instance(seed, dag, domain, outcome, used)
            pending = self._filter_outliers(accepted, outcome, used)
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
                         "regenerations": used.get(domain, 0)},
            })
        return records

    def _instance(self, seed: dict, dag: dict, domain: str, outcome: GroupOutcome, used: dict):
        """Instantiate and verify one domain until it passes or its budget is spent."""
        s = self.settings
        while True:
            try:
                inst = parse_instance(self.client.chat(self.prompts.domain_instantiation(dag, domain)))
            except MalformedOutput:
                self._malformed(outcome)
                self._regenerate(outcome, used, domain, f"instance_malformed ({domain})")
                continue
            try:
                ver = parse_verification(self.client.chat(self.prompts.quality_verification(
                    seed["problem"], inst.problem, dag, s.min_score)))
            except MalformedOutput:
                self._malformed(outcome)
                self._regenerate(outcome, used, domain, f"verification_malformed ({domain})")
                continue
            if ver.score >= s.min_score:
                return inst, ver
            self._regenerate(outcome, used, domain, f"low_score ({domain})")

    def _filter_outliers(self, accepted: dict, outcome: GroupOutcome, used: dict) -> list[str]:
        """Domains to regenerate so that step counts and answer types agree; [] if they do."""
        s = self.settings
        types = Counter(answer_type(inst.answer) for inst, _ in accepted.values())
        if len(types) > 1:
            majority = types.most_common(1)[0][0]
            odd = [d for d in s.domains if answer_type(accepted[d][0].answer) != majority][0]
            self._regenerate(outcome, used, odd, "answer_type_mismatch")
            return [odd]
        counts = {d: accepted[d][0].step_count for d in s.domains}
        if max(counts.values()) - min(counts.values()) <= s.max_step_diff:
            return []
        median = statistics.median(counts.values())
        odd = max(s.domains, key=lambda d: abs(counts[d] - median))
        self._regenerate(outcome, used, odd, "step_count_spread")
        return [odd]


def _repair_tail(path: Path, complete_group=None) -> None:
    """Cut a torn last line (and, for the kept file, a torn last group) left by a kill."""
    if not path.exists():
        return
    data = path.read_bytes()
    end = torn_tail_start(data)
    if complete_group is not None and end:
        # a group is written in one write(): only the last group can be short
        last_gid, tail_start, tail_count = None, 0, 0
        offset = 0
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
        if tail_count < complete_group:
            end = tail_start
    cut_torn_tail(path, keep=end)


def _done_seeds(out: Path) -> dict[str, int]:
    """seed_id -> how many times it is recorded (kept or dropped); > 1 would be a duplicate."""
    seen: Counter = Counter()
    kept = out / KEPT_FILE
    if kept.exists():
        groups = set()
        for _, rec in iter_jsonl(kept):
            if rec["group_id"] not in groups:
                groups.add(rec["group_id"])
                seen[rec["seed_id"]] += 1
    dropped = out / DROPPED_FILE
    if dropped.exists():
        for _, rec in iter_jsonl(dropped):
            seen[rec["seed_id"]] += 1
    return dict(seen)


def _check_settings(out: Path, settings: BuildSettings) -> None:
    path = out / SETTINGS_FILE
    wanted = asdict(settings)
    if path.exists():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            raise DataError(f"{path}: not valid JSON; move the output directory away to rebuild") from None
        for key, value in wanted.items():
            if stored.get(key) != value:
                raise UserError(f"{out} was built with {key}={stored.get(key)!r}, this run has "
                                f"{value!r}: resume with the same arguments or use another --out")
    else:
        atomic_write_json(path, wanted)


def compute_stats(out: Path, seeds_total: int, counters: Counters, failed: int) -> dict:
    kept_groups, instances, scores = set(), 0, []
    if (out / KEPT_FILE).exists():
        for _, rec in iter_jsonl(out / KEPT_FILE):
            kept_groups.add(rec["group_id"])
            instances += 1
            if rec.get("alignment_score") is not None:
                scores.append(rec["alignment_score"])
    reasons: Counter = Counter()
    if (out / DROPPED_FILE).exists():
        for _, rec in iter_jsonl(out / DROPPED_FILE):
            reasons[rec["reason"].split(" (")[0]] += 1
    dropped = sum(reasons.values())
    finished = len(kept_groups) + dropped
    return {
        "seeds": seeds_total,
        "kept_groups": len(kept_groups),
        "kept_instances": instances,
        "dropped_groups": dropped,
        "pending_seeds": seeds_total - finished,
        "failed_this_run": failed,
        "retention": len(kept_groups) / finished if finished else None,
        "paper_retention": PAPER_RETENTION,
        "drop_reasons": dict(sorted(reasons.items())),
        "mean_alignment_score": sum(scores) / len(scores) if scores else None,
        "this_run": dict(sorted(counters.values.items())),
    }


class _Recorder:
    """Appends each finished seed to the kept or dropped file and tallies the run for the bar."""

    def __init__(self, out: Path, counters: Counters, bar=None):
        self.out, self.counters, self.bar = out, counters, bar
        self.tally: Counter = Counter()  # kept, dropped, failed (this run)
        self._lock = threading.Lock()

    def __call__(self, outcome: GroupOutcome) -> None:
        """Append the kept group, or the drop reason, of one finished seed."""
        with self._lock:
            if outcome.records is not None:
                append_lines(self.out / KEPT_FILE,
                             [json.dumps(r, ensure_ascii=False) + "\n" for r in outcome.records])
                self.tally["kept"] += 1
            else:
                append_lines(self.out / DROPPED_FILE, [json.dumps(
                    {"seed_id": outcome.seed_id, "reason": outcome.reason,
                     "regenerations": outcome.regenerations, "malformed": outcome.malformed},
                    ensure_ascii=False) + "\n"])
                self.tally["dropped"] += 1
            self._show()

    def _show(self) -> None:
        """Advance the progress bar, if any, by one seed and refresh its counts."""
        if self.bar is None:
            return
        self.bar.update(1)
        self.bar.set_postfix(kept=self.tally["kept"], dropped=self.tally["dropped"],
                             retried=self.counters.get("http_retries") + self.counters.get("regenerations"),
                             failed=self.tally["failed"], refresh=False)

    def close(self) -> None:
        """Close the progress bar, if any."""
        if self.bar is not None:
            self.bar.close()


def _seeds_to_do(out: Path, seeds: list[dict], settings: BuildSettings) -> list[dict]:
    """Prepare ``out`` for a new or resumed build; return the seeds in neither output file."""
    make_dir(out)
    _check_settings(out, settings)
    _repair_tail(out / KEPT_FILE, complete_group=len(settings.domains))
    _repair_tail(out / DROPPED_FILE)
    done = _done_seeds(out)
    return [s for s in seeds if s["seed_id"] not in done]


def _process_seeds(todo: list[dict], processor: SeedProcessor, recorder: _Recorder,
                   concurrency: int) -> list[BaseException]:
    """Run ``processor`` on ``todo`` in threads, recording each outcome as it finishes.

    Returns the fatal errors: after the first, no seed is started and queued ones are cancelled.
    A seed whose requests failed after all retries is counted as failed and left unrecorded.
    """
    fatal: list[BaseException] = []
    pending: set[Future] = set()
    it = iter(todo)
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="teacher") as pool:
        try:
            while True:
                # submit lazily, a bounded number ahead, so a fatal error stops the rest early
                while len(pending) < 2 * concurrency and not fatal:
                    seed = next(it, None)
                    if seed is None:
                        break
                    pending.add(pool.submit(processor, seed))
                if not pending:
                    break
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    try:
                        recorder(fut.result())
                    except TeacherError:
                        recorder.tally["failed"] += 1  # not recorded: the next run retries this seed
                    except UserError as exc:
                        fatal.append(exc)
                if fatal:
                    for fut in pending:
                        fut.cancel()
        except KeyboardInterrupt:
            for fut in pending:
                fut.cancel()
            raise
        finally:
            recorder.close()
    return fatal


def build(seeds_path: str | Path, out_dir: str | Path, client: ChatClient, settings: BuildSettings,
          prompts: Prompts | None = None, concurrency: int = 4, counters: Counters | None = None,
          progress: bool = True) -> dict:
    """Run (or resume) the pipeline; return the stats also written to ``stats.json``."""
    if concurrency < 1:
        raise UserError(f"--concurrency {concurrency}: expected at least 1")
    seeds = read_seeds(seeds_path)
    prompts = prompts or Prompts()
    if not settings.templates_sha256:
        settings.templates_sha256 = prompts.fingerprint()
    counters = counters or getattr(client, "counters", None) or Counters()
    out = Path(out_dir)
    todo = _seeds_to_do(out, seeds, settings)

    processor = SeedProcessor(client, prompts, settings, counters)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(seeds), initial=len(seeds) - len(todo), unit="seed", desc="build")
    recorder = _Recorder(out, counters, bar)
    fatal = _process_seeds(todo, processor, recorder, concurrency)
    # written after a fatal error too: the stats count what this run did record
    stats = compute_stats(out, len(seeds), counters, recorder.tally["failed"])
    atomic_write_json(out / STATS_FILE, stats)
    if fatal:
        raise fatal[0]
    return stats
