"""Which rank is gone? Heartbeats beside the process group, so a lost node has a name.

A collective with a dead peer either fails at once with the transport's words (gloo: "Connection
reset by peer [10.0.0.12]:43121", when the peer's kernel still answers) or, when the node is
simply gone, waits until the process group's timeout (DeepSpeed's default: 10 minutes; NCCL may
wait longer). Neither names the rank. :class:`PeerWatch` gives every rank a thread that writes a
heartbeat into a small key-value store of its own (a ``torch.distributed.TCPStore`` hosted by
rank 0) and reads everyone else's:

* a rank silent for ``timeout_s`` is lost: the watching rank prints one line naming it (rank,
  host, seconds since its last heartbeat) and ends with exit code :data:`EXIT_PEER_LOST`,
  instead of waiting in a collective that can no longer finish;
* when a collective fails in the training loop, :meth:`PeerWatch.raise_if_lost` waits a few
  heartbeats and raises :class:`PeerLostError` naming the silent rank(s), or returns when every
  rank still beats (the failure was something else);
* the store's host is rank 0: a rank that cannot reach the store for ``timeout_s`` names rank 0;
* a rank that finished says so (:meth:`PeerWatch.stop`), so ranks leaving at slightly different
  times are not taken for lost.

Everything here runs after the process group is up; one rank alone (world size 1) watches
nothing.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time

from iga_ds.cluster.ranks import DistEnv
from iga_ds.errors import UserError

EXIT_PEER_LOST = 4
DONE = "done"
# After a failed collective, a rank silent this long (and at least this many heartbeats) is
# named as the cause: live ranks beat every interval whatever their main thread is doing.
SUSPECT_AFTER_BEATS = 5


class PeerLostError(UserError):
    """Another rank stopped answering: the message names it; exit code :data:`EXIT_PEER_LOST`."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=EXIT_PEER_LOST)


class PeerWatch:
    """Heartbeats of all ranks through a store rank 0 hosts; see the module docstring."""

    def __init__(self, dist: DistEnv, timeout_s: float, interval_s: float = 1.0):
        if not timeout_s > 0 or not interval_s > 0:
            raise UserError(f"peer watch: timeout {timeout_s} s and interval {interval_s} s must be positive")
        self.dist = dist
        self.timeout_s = float(timeout_s)
        self.interval_s = min(float(interval_s), self.timeout_s / 4)
        self.hosts: list[str] = [""] * dist.world_size
        self._store = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._explaining = threading.Event()
        self._lock = threading.Lock()
        self._last_value: list[str | None] = [None] * dist.world_size
        self._last_change = [time.monotonic()] * dist.world_size
        self._store_ok_at = time.monotonic()  # the last store round trip that came back

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> PeerWatch:
        """Collective: every rank of the process group calls it once, after the group is up."""
        if self.dist.world_size < 2:
            return self
        import torch.distributed as tdist

        self._store = self._connect(tdist)
        self._store.set(self._key("host", self.dist.rank), socket.gethostname())
        self._beat(0)
        tdist.barrier()  # every rank's first heartbeat is in: reads never wait for a missing key
        self.hosts = [self._store.get(self._key("host", r)).decode() for r in range(self.dist.world_size)]
        now = time.monotonic()
        self._last_change = [now] * self.dist.world_size
        self._store_ok_at = now
        # Two threads: a store call to a host that went silent may never return, so the one that
        # judges does no I/O and sees the other's last successful round trip age.
        self._threads = [threading.Thread(target=target, name=f"iga-ds peer {name}", daemon=True)
                         for name, target in (("heartbeat", self._run_heartbeat), ("judge", self._run_judge))]
        for thread in self._threads:
            thread.start()
        return self

    def _connect(self, tdist):
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.timeout_s)
        port = [None]
        store = None
        if self.dist.rank == 0:
            # a port of its own: the rendezvous port belongs to the process group
            store = TCPStore(self.dist.master_addr, 0, is_master=True, timeout=timeout, wait_for_workers=False)
            port = [store.port]
        tdist.broadcast_object_list(port, src=0)
        if store is None:
            store = TCPStore(self.dist.master_addr, int(port[0]), is_master=False, timeout=timeout)
        return store

    def stop(self) -> None:
        """This rank is done (finished or stopped): others stop watching it."""
        if self._store is None or self._stopping.is_set():
            return
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=self.interval_s * 5)
        if any(thread.is_alive() for thread in self._threads):
            return  # a store call that never came back holds the client: the store's host is gone
        with contextlib.suppress(RuntimeError, OSError):  # the store's host may have left: nobody watches then
            self._store.set(self._key("alive", self.dist.rank), DONE)

    # -- verdicts ----------------------------------------------------------------------------
    def lost(self, silent_for: float | None = None) -> list[tuple[int, float]]:
        """(rank, seconds since its last heartbeat) of every rank silent longer than
        ``silent_for`` (default: the timeout)."""
        limit = self.timeout_s if silent_for is None else silent_for
        now = time.monotonic()
        with self._lock:
            if self.dist.rank != 0 and now - self._store_ok_at > limit:
                return [(0, now - self._store_ok_at)]  # rank 0 hosts the store
            return [(r, now - t) for r, t in enumerate(self._last_change)
                    if r != self.dist.rank and self._last_value[r] != DONE and now - t > limit]

    def describe_lost(self, lost: list[tuple[int, float]]) -> str:
        me = self.dist
        names = ", ".join(f"rank {r} on {self.hosts[r] or '?'} (no heartbeat for {s:.0f} s)" for r, s in lost)
        return (f"rank {me.rank}/{me.world_size} on {socket.gethostname()} lost contact with {names}; "
                f"the peer timeout is {self.timeout_s:g} s. That node or process is gone: see its log, "
                f"then resume from the last checkpoint")

    def raise_if_lost(self, failure: BaseException) -> None:
        """After ``failure`` in a collective: raise :class:`PeerLostError` naming the silent
        rank(s), waiting up to a few heartbeats (at most the timeout) for them to show; return
        when every other rank still beats."""
        if not self._threads or isinstance(failure, UserError):  # our own errors never mean a lost rank
            return
        self._explaining.set()
        suspect_after = min(self.timeout_s, SUSPECT_AFTER_BEATS * self.interval_s)
        deadline = time.monotonic() + suspect_after + 2 * self.interval_s
        while True:
            lost = self.lost(silent_for=suspect_after)
            if lost:
                first = str(failure).splitlines()[0] if str(failure) else type(failure).__name__
                raise PeerLostError(f"{self.describe_lost(lost)} (the collective failed with: {first[:300]})") \
                    from failure
            if time.monotonic() > deadline:
                self._explaining.clear()
                return
            time.sleep(self.interval_s / 2)

    # -- the thread --------------------------------------------------------------------------
    def _key(self, kind: str, rank: int) -> str:
        return f"iga-ds/{kind}/{rank}"

    def _beat(self, count: int) -> None:
        self._store.set(self._key("alive", self.dist.rank), str(count))

    def _run_heartbeat(self) -> None:
        count = 0
        keys = [self._key("alive", r) for r in range(self.dist.world_size)]
        while not self._stopping.wait(self.interval_s):
            count += 1
            self._observe(keys, count)

    def _run_judge(self) -> None:
        while not self._stopping.wait(self.interval_s):
            lost = self.lost()
            if lost and not self._explaining.is_set():
                print(f"iga-ds: {self.describe_lost(lost)}", file=sys.stderr, flush=True)
                os._exit(EXIT_PEER_LOST)

    def _observe(self, keys: list[str], count: int) -> None:
        try:
            self._beat(count)
            values = [v.decode() for v in self._store.multi_get(keys)]
        except (RuntimeError, OSError):  # the store's host is unreachable: rank 0 (or the network) is gone
            return
        now = time.monotonic()
        with self._lock:
            self._store_ok_at = now
            for rank, value in enumerate(values):
                if value != self._last_value[rank]:
                    self._last_value[rank] = value
                    self._last_change[rank] = now
