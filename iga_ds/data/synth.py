"""Procedural Logical Isomer Sets with an optional planted shortcut.

A group is one typed logical DAG (``iga_ds.data.patterns``), solved by forward chaining
(``iga_ds.data.dag``) and rendered in every domain (``iga_ds.data.render``): the instances of a
group share the DAG, the chain of thought step for step, and the answer exactly. This is the
embedded default data set and the controlled benchmark for shortcut learning: with
``shortcut=s`` every instance opens with a domain-specific cue sentence whose slot word
predicts the answer with probability ``s`` in the training split and is independent of the
answer in the test split (paper, section 1: shortcuts are domain-specific surface features).

Two variants of the benchmark: the negative control (``shortcut=s``: the same agreement in
every domain, so the shortcut is invariant across environments) and diverse environments
(``shortcut_by_domain``: a different agreement per domain, paper, Assumption 4). The test
split's cue is independent of the answer, or, with ``test_cue="adversarial"``, always wrong.
Every test instance with a planted cue carries ``meta.cue_counterfactual``: its problem with the
cue signalling the true answer and with the cue signalling a wrong one.

Determinism: group ``i`` depends only on ``(seed, i)`` and its split, so the same arguments
give byte-identical files.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from iga_ds.data.dag import solve
from iga_ds.data.domains import DEFAULT_DOMAINS, DOMAINS, Domain, get_domain
from iga_ds.data.patterns import BOOLEAN_ANSWERS, INTEGER_ANSWERS, PATTERNS, SAMPLERS, SLOT_KIND
from iga_ds.data.render import abstract_statements, render_cot, render_problem, replace_cue, slot_words
from iga_ds.errors import UserError
from iga_ds.files import atomic_write_json, make_dir, temp_file_beside
from iga_ds.progress import progress as progress_of

FORMAT_VERSION = 1
TEST_FRAC = 0.2
TEST_CUES = ("independent", "adversarial")


def parse_shortcut_by_domain(text: str) -> dict[str, float]:
    """``"math=1.0,legal=0.3"`` -> ``{"math": 1.0, "legal": 0.3}`` (``--shortcut-by-domain``)."""
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name or not value:
            raise UserError(f"--shortcut-by-domain {text!r}: expected DOMAIN=PROBABILITY items separated "
                            "by commas, e.g. math=1.0,medical=0.9,legal=0.7,science=0.3")
        if name in out:
            raise UserError(f"--shortcut-by-domain {text!r}: domain {name!r} is listed twice")
        try:
            out[name] = float(value)
        except ValueError:
            raise UserError(f"--shortcut-by-domain {name}={value}: expected a probability in [0, 1]") from None
    return out


def _check_shortcut_by_domain(by_domain, domains: Sequence[str], neutral_cue: bool) -> None:
    """A probability in [0, 1] for every domain of the run and for no other."""
    flag = "--shortcut-by-domain"
    if not isinstance(by_domain, Mapping):
        raise UserError(f"{flag}: expected a mapping of domain to probability, found {type(by_domain).__name__}")
    if neutral_cue:
        raise UserError(f"--neutral-cue with {flag}: a neutral cue carries no shortcut; expected one of the two")
    for name, value in by_domain.items():
        if name not in domains:
            raise UserError(f"{flag}: {name!r} is not a domain of this run; expected some of {', '.join(domains)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise UserError(f"{flag} {name}={value}: expected a probability in [0, 1]")
    missing = [d for d in domains if d not in by_domain]
    if missing:
        raise UserError(f"{flag}: no probability for {', '.join(missing)}; expected one for every domain "
                        f"of the run ({', '.join(domains)})")


def _check_cue_args(domains: Sequence[str], shortcut: float, neutral_cue: bool,
                    shortcut_by_domain, test_cue: str) -> None:
    if not 0.0 <= shortcut <= 1.0:
        raise UserError(f"--shortcut {shortcut}: expected a probability in [0, 1]")
    if neutral_cue and shortcut > 0.0:
        raise UserError(f"--neutral-cue with --shortcut {shortcut}: a neutral cue carries no shortcut; "
                        "expected --shortcut 0")
    if shortcut_by_domain is not None:
        _check_shortcut_by_domain(shortcut_by_domain, domains, neutral_cue)
    if test_cue not in TEST_CUES:
        raise UserError(f"--test-cue {test_cue!r}: expected one of {', '.join(TEST_CUES)}")
    if test_cue != "independent" and shortcut == 0.0 and shortcut_by_domain is None:
        raise UserError(f"--test-cue {test_cue}: no shortcut is planted; expected --shortcut above 0 "
                        "or --shortcut-by-domain")


def _check_args(groups: int, domains: Sequence[str], shortcut: float, patterns: Sequence[str],
                min_depth: int, max_depth: int, test_frac: float, neutral_cue: bool = False,
                shortcut_by_domain=None, test_cue: str = "independent") -> None:
    if not isinstance(groups, int) or groups < 1:
        raise UserError(f"--groups {groups!r}: expected a positive integer")
    if not domains:
        raise UserError("--domains: expected at least one domain")
    if len(set(domains)) != len(domains):
        raise UserError(f"--domains {','.join(domains)}: a domain is listed twice")
    for d in domains:
        get_domain(d)
    _check_cue_args(domains, shortcut, neutral_cue, shortcut_by_domain, test_cue)
    for p in patterns:
        if p not in SAMPLERS:
            raise UserError(f"--patterns: unknown pattern {p!r}; expected some of {', '.join(PATTERNS)}")
    if not patterns:
        raise UserError("--patterns: expected at least one pattern")
    if not 1 <= min_depth <= max_depth <= 4:
        raise UserError(f"--min-depth {min_depth} / --max-depth {max_depth}: expected 1 <= min <= max <= 4")
    if not 0.0 <= test_frac < 1.0:
        raise UserError(f"--test-frac {test_frac}: expected a fraction in [0, 1)")


def test_indices(groups: int, seed: int, test_frac: float = TEST_FRAC) -> set[int]:
    """Seed-level split: exactly round(test_frac * groups) groups go to test."""
    n_test = int(round(test_frac * groups))
    return set(random.Random(f"split:{seed}").sample(range(groups), n_test))


def _group_rng(seed: int, index: int) -> random.Random:
    # a stable 64-bit hash of (seed, index): same stream on every run and platform, and
    # cheaper than a string seed (which random hashes with sha512)
    key = hashlib.blake2b(f"group:{seed}:{index}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(key, "little"))


def _record_rng(seed: int, index: int, domain: str) -> random.Random:
    # the counterfactual cue of one instance: a stream of its own, so that drawing it leaves the
    # group's stream, and with it every other field, as it would be without it
    key = hashlib.blake2b(f"counterfactual:{seed}:{index}:{domain}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(key, "little"))


def _cue(domain: Domain, answer: str, answers: Sequence[str], split: str, shortcut: float,
         rng: random.Random, neutral: bool = False,
         test_cue: str = "independent") -> tuple[str, str, bool]:
    """(cue sentence, answer the cue signals, whether it agrees with the true answer)."""
    if split == "train" and not neutral:
        if rng.random() < shortcut:
            signalled = answer
        else:
            signalled = rng.choice([a for a in answers if a != answer])
    elif test_cue == "adversarial" and not neutral:
        signalled = rng.choice([a for a in answers if a != answer])  # always wrong
    else:
        signalled = rng.choice(answers)  # independent of the answer
    return domain.cue_sentence(signalled), signalled, signalled == answer


def _counterfactual(domain: Domain, problem: str, cue: str, answer: str, answers: Sequence[str],
                    rng: random.Random) -> dict:
    """``problem`` with the cue signalling the true answer, and with it signalling a wrong one."""
    wrong = rng.choice([a for a in answers if a != answer])
    return {
        "right": {"problem": replace_cue(problem, cue, domain.cue_sentence(answer)), "cue_answer": answer},
        "wrong": {"problem": replace_cue(problem, cue, domain.cue_sentence(wrong)), "cue_answer": wrong},
    }


def _sample_dag(rng: random.Random, patterns: Sequence[str], min_depth: int, max_depth: int):
    """(pattern, depth, DAG, solution) of one group, drawn from the group's stream."""
    pattern = patterns[rng.randrange(len(patterns))]
    depth = rng.randint(min_depth, max_depth)
    want_yes = rng.random() < 0.5
    dag = SAMPLERS[pattern](rng, depth, want_yes)
    solution = solve(dag)
    if pattern != "arithmetic" and (solution.answer == "yes") != want_yes:
        raise AssertionError(f"{pattern} sampler built a DAG whose answer is {solution.answer}")
    return pattern, depth, dag, solution


def make_group(seed: int, index: int, split: str, domains: Sequence[str] = DEFAULT_DOMAINS,
               shortcut: float = 0.0, patterns: Sequence[str] = PATTERNS,
               min_depth: int = 1, max_depth: int = 4, neutral_cue: bool = False,
               answer_only: bool = False, shortcut_by_domain: Mapping[str, float] | None = None,
               test_cue: str = "independent") -> list[dict]:
    """All instances (one per domain) of group ``index``.

    ``neutral_cue`` renders the cue sentence in every split with a slot word independent of the
    answer (text that shows the cue words without teaching the shortcut, e.g. to pretrain a
    base); ``answer_only`` leaves ``cot`` empty, so the target is the answer line alone;
    ``shortcut_by_domain`` (domain -> agreement in train) replaces ``shortcut``; ``test_cue``
    is ``independent`` or ``adversarial`` (the test cue always signals a wrong answer).
    """
    rng = _group_rng(seed, index)
    pattern, depth, dag, solution = _sample_dag(rng, patterns, min_depth, max_depth)
    statements, question = abstract_statements(dag)
    n_slots = sum(1 for n in dag["nodes"] if "slot" in n)
    answers = INTEGER_ANSWERS if question[0] == "num" else BOOLEAN_ANSWERS
    # CoT lines before "Answer:": one per derivation, plus a closing line for yes/no goals
    dag["step_count"] = len(solution.steps) + (question[0] != "num")
    group_id = f"synth-{seed}-{index:07d}"
    cued = shortcut > 0.0 or neutral_cue or shortcut_by_domain is not None
    records = []
    for name in domains:
        domain = DOMAINS[name]
        lexicon = rng.sample(getattr(domain, SLOT_KIND[pattern]), n_slots)
        words = slot_words(dag, lexicon)
        meta = {"pattern": pattern, "depth": depth, "split": split, "status": solution.status,
                "lexicon": lexicon, "cue": None, "cue_answer": None, "cue_agrees": None}
        cue = None
        if cued:
            strength = shortcut if shortcut_by_domain is None else shortcut_by_domain[name]
            cue, meta["cue_answer"], meta["cue_agrees"] = _cue(
                domain, solution.answer, answers, split, strength, rng, neutral_cue, test_cue)
            meta["cue"] = cue
        # render_cot draws nothing from rng: skipping it leaves every other field unchanged
        cot = "" if answer_only else render_cot(domain, solution, question, words)
        problem = render_problem(domain, statements, question, words, cue)
        if cue is not None and split == "test" and not neutral_cue:
            meta["cue_counterfactual"] = _counterfactual(domain, problem, cue, solution.answer, answers,
                                                         _record_rng(seed, index, name))
        records.append({
            "group_id": group_id,
            "seed_id": group_id,
            "domain": name,
            "problem": problem,
            "cot": cot,
            "answer": solution.answer,
            "dag": dag,
            "meta": meta,
        })
    return records


def iter_groups(groups: int, seed: int, domains: Sequence[str] = DEFAULT_DOMAINS,
                shortcut: float = 0.0, patterns: Sequence[str] = PATTERNS,
                min_depth: int = 1, max_depth: int = 4,
                test_frac: float = TEST_FRAC, neutral_cue: bool = False,
                answer_only: bool = False, shortcut_by_domain: Mapping[str, float] | None = None,
                test_cue: str = "independent") -> Iterator[list[dict]]:
    """Yield the records of each group in index order; ``meta.split`` says train or test."""
    _check_args(groups, domains, shortcut, patterns, min_depth, max_depth, test_frac, neutral_cue,
                shortcut_by_domain, test_cue)
    test = test_indices(groups, seed, test_frac)
    for i in range(groups):
        yield make_group(seed, i, "test" if i in test else "train", domains, shortcut,
                         patterns, min_depth, max_depth, neutral_cue, answer_only,
                         shortcut_by_domain, test_cue)


def generate_groups(groups: int, seed: int, domains: Sequence[str] = DEFAULT_DOMAINS,
                    shortcut: float = 0.0, **kw) -> list[dict]:
    """All records in memory (train and test together; ``meta.split`` tells them apart)."""
    return [r for group in iter_groups(groups, seed, domains, shortcut, **kw) for r in group]


# one encoder for all lines: json.dumps with options would build a new one per call
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _dump_group(group: list[dict]) -> list[str]:
    """JSON lines of one group; the shared DAG is encoded once (it dominates the cost)."""
    dag_json = _encode(group[0]["dag"])
    lines = []
    for r in group:
        head = {k: r[k] for k in ("group_id", "seed_id", "domain", "problem", "cot", "answer")}
        lines.append(_encode(head)[:-1] + ',"dag":' + dag_json
                     + ',"meta":' + _encode(r["meta"]) + "}\n")
    return lines


class _HashingWriter:
    """Streams lines to a temp file beside ``path``, hashing as it goes; ``commit`` renames."""

    def __init__(self, path: Path):
        self.path = path
        fd, self.tmp = temp_file_beside(path)
        self.f = os.fdopen(fd, "wb")
        self.sha = hashlib.sha256()
        self.records = 0

    def write(self, lines: Iterable[str]) -> None:
        data = "".join(lines).encode("utf-8")
        self.sha.update(data)
        self.f.write(data)

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class _SplitTally:
    """What the manifest says about one split: groups by pattern, depth and answer, cue agreement."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.cue_agrees = 0  # instances whose cue signals the true answer
        self.domain_agrees: Counter = Counter()  # the same, by domain
        self.domain_instances: Counter = Counter()

    def add(self, group: list[dict], with_cue: bool) -> None:
        """Count one group (its first instance carries the group's pattern, depth and answer)."""
        meta = group[0]["meta"]
        self.counts["groups"] += 1
        self.counts[f"pattern:{meta['pattern']}"] += 1
        self.counts[f"depth:{meta['depth']}"] += 1
        self.counts[f"answer:{group[0]['answer']}"] += 1
        if with_cue:
            for r in group:
                agrees = r["meta"]["cue_agrees"]
                self.cue_agrees += agrees
                self.domain_agrees[r["domain"]] += agrees
                self.domain_instances[r["domain"]] += 1

    def _by(self, prefix: str) -> dict:
        """The counts under ``prefix:``, keyed by what follows it, in sorted order."""
        return {k.split(":", 1)[1]: v for k, v in sorted(self.counts.items()) if k.startswith(prefix + ":")}

    def summary(self, instances: int, with_cue: bool) -> dict:
        """The manifest entry of this split, which holds ``instances`` records."""
        summary = {
            "groups": self.counts["groups"],
            "instances": instances,
            "patterns": self._by("pattern"),
            "depths": self._by("depth"),
            "answers": self._by("answer"),
        }
        if with_cue:
            summary["cue_agreement"] = self.cue_agrees / instances if instances else None
            summary["cue_agreement_by_domain"] = {d: self.domain_agrees[d] / n
                                                  for d, n in self.domain_instances.items()}
        return summary


def _write_splits(out: Path, groups: Iterable[list[dict]], total: int, with_cue: bool,
                  progress: bool) -> tuple[dict[str, _HashingWriter], dict[str, _SplitTally]]:
    """Stream each group into train.jsonl or test.jsonl, all or nothing; return writers and tallies."""
    writers: dict[str, _HashingWriter] = {}
    tallies = {"train": _SplitTally(), "test": _SplitTally()}
    bar = progress_of(total, "synth", "group") if progress else None
    try:
        for split in ("train", "test"):
            writers[split] = _HashingWriter(out / f"{split}.jsonl")
        for i, group in enumerate(groups):
            split = group[0]["meta"]["split"]
            tallies[split].add(group, with_cue)
            writers[split].write(_dump_group(group))
            writers[split].records += len(group)
            if bar is not None and (i + 1) % 1000 == 0:
                bar.update(1000)
        for w in writers.values():
            w.commit()
    except BaseException:
        # leave no temp file behind
        for w in writers.values():
            w.abort()
        raise
    finally:
        if bar is not None:
            bar.update(bar.total - bar.n)
            bar.close()
    return writers, tallies


def synthesize(out_dir, groups: int, seed: int, domains: Sequence[str] = DEFAULT_DOMAINS,
               shortcut: float = 0.0, patterns: Sequence[str] = PATTERNS, min_depth: int = 1,
               max_depth: int = 4, test_frac: float = TEST_FRAC, progress: bool = False,
               neutral_cue: bool = False, answer_only: bool = False,
               shortcut_by_domain: Mapping[str, float] | None = None,
               test_cue: str = "independent") -> dict:
    """Write ``train.jsonl``, ``test.jsonl`` and ``manifest.json`` to ``out_dir``; return the manifest."""
    domains, patterns = tuple(domains), tuple(patterns)
    _check_args(groups, domains, shortcut, patterns, min_depth, max_depth, test_frac, neutral_cue,
                shortcut_by_domain, test_cue)
    out = make_dir(out_dir)
    with_cue = shortcut > 0.0 or neutral_cue or shortcut_by_domain is not None
    writers, tallies = _write_splits(
        out, iter_groups(groups, seed, domains, shortcut, patterns, min_depth, max_depth, test_frac,
                         neutral_cue, answer_only, shortcut_by_domain, test_cue),
        groups, with_cue, progress)
    arguments = {
        "groups": groups, "seed": seed, "domains": list(domains), "shortcut": shortcut,
        "patterns": list(patterns), "min_depth": min_depth, "max_depth": max_depth,
        "test_frac": test_frac, "neutral_cue": neutral_cue, "answer_only": answer_only,
    }
    # listed only when set, so that a run without them writes the manifest it always wrote
    if shortcut_by_domain is not None:
        arguments["shortcut_by_domain"] = {d: float(shortcut_by_domain[d]) for d in domains}
    if test_cue != "independent":
        arguments["test_cue"] = test_cue
    manifest = {
        "generator": "iga_ds.data.synth",
        "format_version": FORMAT_VERSION,
        "arguments": arguments,
        "splits": {s: tallies[s].summary(writers[s].records, with_cue) for s in ("train", "test")},
        "files": {
            f"{s}.jsonl": {"sha256": writers[s].sha.hexdigest(), "records": writers[s].records}
            for s in ("train", "test")
        },
    }
    atomic_write_json(out / "manifest.json", manifest)
    return manifest
