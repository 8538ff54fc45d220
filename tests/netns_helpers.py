"""Several "nodes" on one machine: Linux network namespaces joined by a bridge.

One hub namespace holds a bridge (``br0``, the cluster network) and the controller's address;
each node gets its own namespace with one end of a veth pair on that bridge, its own address,
its own host name (a UTS namespace) and an ``/etc/hosts`` that names every node (bind-mounted
in a private mount namespace, so the machine's own file is untouched). A process started
through :meth:`NodeNetwork.argv` lives on that node: it sees only the node's interfaces, so
whatever it sends to another node crosses the bridge, and nothing reaches the machine's own
network. Filesystem paths are shared, as on a cluster with a shared filesystem.

Needs root, ``ip`` (iproute2), ``nsenter`` and ``unshare`` (util-linux), ``mount`` and
``hostname`` (Debian packages of the same names). Namespace names carry the creating process id
and a random token, so parallel test runs never collide; :meth:`NodeNetwork.start` also removes
namespaces left by test processes that no longer exist (killed before their clean-up ran).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = "/run/netns"  # where `ip netns add` keeps its namespaces
SUBNET = "10.77.0"  # inside the namespaces only: every run has its own bridge, so runs may share it
NAME_PREFIX = "igatest"
_OWNER = re.compile(rf"^{NAME_PREFIX}(\d+)x[0-9a-f]+-")
# The programs the nodes are built with, and the Debian package of each (.ci/system-deps installs them)
TOOL_PACKAGES = {"ip": "iproute2", "nsenter": "util-linux", "unshare": "util-linux", "mount": "mount",
                 "hostname": "hostname"}
# Enters the node's own host name and hosts file, then becomes the command (exec: same pid).
_ENTER_NODE = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


@dataclass(frozen=True)
class Node:
    name: str  # host name inside the namespace (and the Slurm node name)
    address: str
    netns: str


def missing_netns_support() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in TOOL_PACKAGES.items():
        if _which(tool) is None:
            return f"{tool} not installed (Debian {package}; .ci/system-deps installs it)"
    probe = f"{NAME_PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:  # e.g. a container without CAP_NET_ADMIN
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([_which("ip") or "ip", *args], check=check, capture_output=True, text=True, timeout=30)


class NodeNetwork:
    """A hub namespace (bridge, controller address) and ``nodes`` node namespaces.

    Use as a context manager; :meth:`stop` kills every process left in the namespaces and
    deletes them, also after a failed start."""

    def __init__(self, root: str | os.PathLike, nodes: int = 2, hub_name: str = "ctl"):
        token = f"{NAME_PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.root = Path(root)
        self.hub = Node(hub_name, f"{SUBNET}.1", f"{token}-hub")
        self.nodes = [Node(f"node{i}", f"{SUBNET}.{10 + i}", f"{token}-node{i}") for i in range(1, nodes + 1)]
        self.hosts_file = self.root / "hosts"
        self._created: list[str] = []

    def __enter__(self) -> NodeNetwork:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def node(self, name: str) -> Node:
        return next(n for n in [self.hub, *self.nodes] if n.name == name)

    def start(self) -> None:
        sweep_stale_namespaces()
        self.root.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{n.address} {n.name}" for n in [self.hub, *self.nodes]]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        self._add_netns(self.hub.netns)
        _ip("-n", self.hub.netns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub.netns, "addr", "add", f"{self.hub.address}/24", "dev", "br0")
        _ip("-n", self.hub.netns, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes, 1):
            self._add_netns(node.netns)
            # the veth pair is made inside the hub, so its names never meet another run's
            _ip("-n", self.hub.netns, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0",
                "netns", node.netns)
            _ip("-n", self.hub.netns, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def argv(self, where: str, argv: list[str]) -> list[str]:
        """``argv`` run on node ``where`` (or the hub): its network, host name and hosts file."""
        node = self.node(where)
        # nsenter, not `ip netns exec`: that one remounts /sys, hiding the cgroup tree slurmd needs
        return [_which("nsenter") or "nsenter", f"--net={NETNS_DIR}/{node.netns}", "--",
                _which("unshare") or "unshare", "--uts", "--mount", "--propagation", "private", "--",
                "sh", "-c", _ENTER_NODE, "enter-node", str(self.hosts_file), node.name, *argv]

    def write_remote_shell(self, path: str | os.PathLike) -> Path:
        """An ``ssh`` stand-in (``AGENT HOST COMMAND...``): runs the command through ``sh -c`` on
        that node, as ssh runs it in the remote login shell. For launchers that reach other
        hosts through ssh, e.g. Open MPI's ``--mca plm_rsh_agent``."""
        prefixes = {node.name: self.argv(node.name, []) for node in self.nodes}
        path = Path(path)
        path.write_text(textwrap.dedent(f"""\
            #!{sys.executable}
            import os, sys
            prefixes = {prefixes!r}
            host, command = sys.argv[1], " ".join(sys.argv[2:])
            if host not in prefixes:
                sys.exit(f"remote shell: no node {{host!r}} (known: {{', '.join(prefixes)}})")
            argv = prefixes[host] + ["sh", "-c", command]
            os.execvp(argv[0], argv)
        """))
        path.chmod(0o755)
        return path

    def pids(self, where: str) -> list[int]:
        res = _ip("netns", "pids", self.node(where).netns, check=False)
        return [int(p) for p in res.stdout.split() if p.isdigit()]

    def power_off(self, where: str) -> None:
        """What a node failure looks like from the others: its link goes silent first (no
        reset or FIN reaches them), then every process on it dies."""
        node = self.node(where)
        index = self.nodes.index(node) + 1
        _ip("-n", self.hub.netns, "link", "set", f"v{index}", "down")
        _kill_all(self.pids(where))

    def link_bytes(self, where: str) -> int:
        """Bytes through node ``where``'s link to the bridge so far, both directions."""
        index = self.nodes.index(self.node(where)) + 1
        res = _ip("-j", "-s", "-n", self.hub.netns, "link", "show", "dev", f"v{index}")
        stats = json.loads(res.stdout)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])

    def stop(self) -> None:
        for name in reversed(self._created):
            _remove_netns(name)
        self._created.clear()


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove_netns(name: str) -> None:
    """Kill what still runs in the namespace (daemons, job steps), then delete it."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", name, check=False).stdout.split() if p.isdigit()]
        if not pids:
            break
        _kill_all(pids)
        time.sleep(0.1)
    _ip("netns", "delete", name, check=False)


def sweep_stale_namespaces() -> list[str]:
    """Delete this module's namespaces whose creating process is gone; returns their names."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listing:
        name = line.split(" ", 1)[0].strip()
        owner = _OWNER.match(name)
        if owner is None or _alive(int(owner.group(1))):
            continue
        _remove_netns(name)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
