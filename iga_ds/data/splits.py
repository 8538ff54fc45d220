"""Train/test splits and group-sampling helpers for the ablations.

- ``split_by_seed``: the paper's split (appendix "Data Split"): 80/20 over seed problems, so
  no instance of a test seed, in any domain, is seen in training.
- ``split_by_instance``: splits single instances, so the isomers of a test instance are in
  training. It exists only for the "w/o seed-level split" ablation (paper Table 3), which
  measures the leakage this causes; the groups it leaves behind are partial.
- ``random_pairing``: the "w/o Isomer Sets (random pairing)" ablation: instances are put into
  fake groups at random, one per domain, so a group is no longer one logical problem.
- ``subset_domains``: single-domain and N-domain subsets (ablations "single domain", N = 2).

All are deterministic in ``seed`` and keep records in input order within each output.
"""
from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from iga_ds.data.groups import first_groups
from iga_ds.data.schema import answer_type
from iga_ds.errors import UserError
from iga_ds.files import read_jsonl, write_jsonl

LEAKAGE_WARNING = (
    "instance-level split: isomers of a test instance stay in training (data leakage); "
    "use it only for the leakage ablation, never to report results"
)


def _check_frac(test_frac: float) -> None:
    if not 0.0 < test_frac < 1.0:
        raise UserError(f"--test-frac {test_frac}: expected a fraction strictly between 0 and 1")


def split_by_seed(records: Sequence[dict], test_frac: float = 0.2, seed: int = 0
                  ) -> tuple[list[dict], list[dict]]:
    """(train, test): exactly round(test_frac * number of seeds) seeds go to test."""
    _check_frac(test_frac)
    seeds = sorted({r["seed_id"] for r in records})
    n_test = int(round(test_frac * len(seeds)))
    test_seeds = set(random.Random(f"split-seed:{seed}").sample(seeds, n_test))
    train = [r for r in records if r["seed_id"] not in test_seeds]
    test = [r for r in records if r["seed_id"] in test_seeds]
    return train, test


def split_by_instance(records: Sequence[dict], test_frac: float = 0.2, seed: int = 0
                      ) -> tuple[list[dict], list[dict]]:
    """(train, test) over single instances: leaks seeds on purpose (ablation only)."""
    _check_frac(test_frac)
    n_test = int(round(test_frac * len(records)))
    test_idx = set(random.Random(f"split-instance:{seed}").sample(range(len(records)), n_test))
    train = [r for i, r in enumerate(records) if i not in test_idx]
    test = [r for i, r in enumerate(records) if i in test_idx]
    return train, test


def random_pairing(records: Sequence[dict], seed: int = 0) -> list[dict]:
    """Shuffle instances into fake groups (one instance per domain each).

    Pairing happens within each answer type, so that a fake group still has one answer type
    (yes/no with yes/no, integers with integers) and the ablation isolates the loss of
    logical isomorphism rather than mixing output formats. The new group and seed ids are
    ``pair-<seed>-<n>``; the original ids are kept in ``meta.orig_group_id`` and
    ``meta.orig_seed_id``. Instances that cannot fill a complete fake group are dropped.
    """
    rng = random.Random(f"pairing:{seed}")
    domains = sorted({r["domain"] for r in records})
    buckets: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        buckets[answer_type(r["answer"])][r["domain"]].append(r)
    out: list[dict] = []
    n = 0
    for atype in sorted(buckets):
        per_domain = buckets[atype]
        columns = []
        for d in domains:
            items = list(per_domain.get(d, []))
            rng.shuffle(items)
            columns.append(items)
        for row in zip(*columns):
            gid = f"pair-{seed}-{n:07d}"
            n += 1
            for r in row:
                meta = dict(r.get("meta") or {})
                meta["orig_group_id"] = r["group_id"]
                meta["orig_seed_id"] = r["seed_id"]
                new = dict(r)
                new.update(group_id=gid, seed_id=gid, meta=meta)
                new.pop("dag", None)  # the fake group has no common DAG
                out.append(new)
    return out


def subset_domains(records: Sequence[dict], domains: Sequence[str]) -> list[dict]:
    """Keep only the instances of ``domains`` (e.g. one domain, or N = 2)."""
    if not domains:
        raise UserError("subset_domains: expected at least one domain")
    present = {r["domain"] for r in records}
    missing = [d for d in domains if d not in present]
    if missing:
        raise UserError(f"--domains: {', '.join(missing)} not in the data "
                        f"(it has {', '.join(sorted(present))})")
    keep = set(domains)
    return [r for r in records if r["domain"] in keep]


def hold_out_last_groups(records: Sequence[dict], n: int) -> tuple[list[dict], list[dict]]:
    """(kept, held out): the last ``n`` groups by first appearance are held out whole, e.g. as
    an in-distribution test set cut from a training split."""
    order = list(dict.fromkeys(r["group_id"] for r in records))
    held = set(order[-n:]) if n > 0 else set()
    return [r for r in records if r["group_id"] not in held], [r for r in records if r["group_id"] in held]


def synthetic_eval_splits(folder: str | Path, id_groups: int, ood_groups: int) -> tuple[Path, Path, Path]:
    """Evaluation sets of a folder ``iga-ds data synth`` wrote: the training split less its last
    ``id_groups`` groups (``fit.jsonl``, what is trained on), those groups (``id_test.jsonl``,
    in distribution: they carry the training split's cue) and the first ``ood_groups`` groups of
    the shortcut-free test split (``ood_test.jsonl``). Returns the three paths."""
    folder = Path(folder)
    fit, held = hold_out_last_groups(read_jsonl(folder / "train.jsonl"), id_groups)
    paths = folder / "fit.jsonl", folder / "id_test.jsonl", folder / "ood_test.jsonl"
    write_jsonl(paths[0], fit)
    write_jsonl(paths[1], first_groups(held, id_groups))
    write_jsonl(paths[2], first_groups(read_jsonl(folder / "test.jsonl"), ood_groups))
    return paths
