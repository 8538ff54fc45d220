"""Slurm node list expansion and hostfiles, checked against Slurm's own ``scontrol show hostnames``."""
from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

from iga_ds.errors import UserError
from iga_ds.cluster.nodelist import expand_nodelist, expand_tasks_per_node, hostfile_text


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu[8-10],login", ["gpu8", "gpu9", "gpu10", "login"]),
        ("a[009-011]", ["a009", "a010", "a011"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("h-[1,3],x[2]", ["h-1", "h-3", "x2"]),
    ],
)
def test_expand_nodelist_examples(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "node[01-03", "node01-03]", "n[3-1]", "n[a-b]", "n[[1]]", "a,,b"])
def test_expand_nodelist_rejects_malformed_with_the_source_named(bad):
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(bad, "SLURM_JOB_NODELIST")


@pytest.mark.parametrize(
    "spec, counts",
    [("8", [8]), ("8(x2),4", [8, 8, 4]), ("2(x3)", [2, 2, 2]), ("1,2(x2),3", [1, 2, 2, 3])],
)
def test_expand_tasks_per_node(spec, counts):
    assert expand_tasks_per_node(spec) == counts


def test_expand_tasks_per_node_rejects_garbage():
    with pytest.raises(UserError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node("8(2)")


def test_hostfile_text_per_host_slots_and_validation():
    assert hostfile_text(["a", "b"], 8) == "a slots=8\nb slots=8\n"
    assert hostfile_text(["a", "b"], [2, 1]) == "a slots=2\nb slots=1\n"
    with pytest.raises(UserError, match="2 hosts but 1"):
        hostfile_text(["a", "b"], [2])
    with pytest.raises(UserError, match="slots must be >= 1"):
        hostfile_text(["a"], 0)


def _random_nodelist(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(["node", "gpu", "r", "dgx-a"])
        n_brackets = rng.randint(0, 2)
        for b in range(n_brackets):
            items = []
            for _ in range(rng.randint(1, 3)):
                width = rng.choice([1, 2, 3])
                lo = rng.randint(0, 12)
                if rng.random() < 0.6:
                    items.append(f"{lo:0{width}d}-{lo + rng.randint(0, 4):0{width}d}")
                else:
                    items.append(f"{lo:0{width}d}")
            name += "[" + ",".join(items) + "]"
            if b < n_brackets - 1:  # Slurm allows text between brackets, not after the last one
                name += rng.choice(["", "-s", "x"])
        parts.append(name)
    return ",".join(parts)


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    exe = shutil.which("scontrol")
    if exe is None:
        pytest.skip("scontrol not installed (Debian slurm-client; .ci/system-deps installs it)")
    conf = tmp_path_factory.mktemp("slurmconf") / "slurm.conf"
    # `scontrol show hostnames` needs a parsable config but no running daemon.
    conf.write_text("ClusterName=ref\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                    "PartitionName=p Nodes=localhost\n")
    env = dict(os.environ, SLURM_CONF=str(conf))

    def expand(nodelist: str) -> list[str]:
        out = subprocess.run([exe, "show", "hostnames", nodelist], env=env, check=True,
                             capture_output=True, text=True, timeout=30)
        return out.stdout.split()

    return expand


def test_expand_nodelist_matches_scontrol_on_random_lists(scontrol):
    rng = random.Random(7)
    cases = [_random_nodelist(rng) for _ in range(40)]
    mismatches = [(c, expand_nodelist(c), scontrol(c)) for c in cases if expand_nodelist(c) != scontrol(c)]
    assert not mismatches, mismatches[:3]
