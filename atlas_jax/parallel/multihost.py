"""Multi-host serving on JAX's own runtime: `jax.distributed` joins the processes, one global ("tp",) mesh spans
every process's devices, every process runs the same compiled steps, and rank 0 alone schedules (HTTP, the
scheduler, the host state of every request).

Step inputs reach the other ranks through the coordination service's key-value store (`jax.distributed`'s
own): before each device call rank 0 publishes it (kind + host arguments, one key per call, numbered), and a
follower (`ModelRunner.follow`) reads the calls in order and runs the same executable on the same arguments.
Chosen over `multihost_utils.broadcast_one_to_all`, a device collective compiled per argument structure:
on two CPU processes a 21 KB call costs 0.37 ms to publish against 5.3 ms to broadcast (docs/performance.md).
Outputs a host reads (sampled tokens, logprobs, drafts, swapped pages) are replicated on every device by the
step (`runner._keeping_state`), so rank 0 reads its own copy (`to_host`) with no collective of its own.

Failure: a rank that dies breaks the collectives of the step in flight (an error on the others at once) and
stops sending heartbeats; the coordination service then ends every other process (SIGABRT, JAX logging
"Terminating process because the JAX distributed service detected fatal errors") within `dist_timeout`
seconds; a follower whose rank 0 (the coordination service's host) dies is ended the same way. Rank 0's
`close()` sends STOP: the followers return. Preemption is by recompute (a swapped sequence's KV would
otherwise travel through the key-value store on every swap-in).
The key-value store is the cluster's: keep the coordinator port private (calls are pickled).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
import threading
import time

import jax
import numpy as np

log = logging.getLogger("atlas_jax.parallel")

PREFIX = "atlas_jax/call"
STOP = "__stop__"
PART_BYTES = 1 << 20             # a call's pickle is stored in parts of at most this many bytes
KEEP_CALLS = 1024                # rank 0 deletes a call this many calls later ...
ACK_EVERY = KEEP_CALLS // 2      # ... and every this many calls waits until each follower has read that far back
_ENGINES = itertools.count()     # engines made in this process: every rank makes them in the same order
POLL_MS = 1000                   # a follower's blocking read wakes this often to see whether rank 0 is gone


@dataclasses.dataclass(frozen=True)
class Distributed:
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None       # HOST:PORT of rank 0's coordination service
    dist_timeout: int = 60                  # seconds without a rank's heartbeat before every rank is ended

    @classmethod
    def from_args(cls, args) -> "Distributed":
        """From EngineArgs' nnodes / node_rank / dist_init_addr / dist_timeout."""
        return cls(args.nnodes, args.node_rank, args.dist_init_addr, args.dist_timeout)

    @property
    def multihost(self) -> bool:
        return self.nnodes > 1

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    def check(self) -> "Distributed":
        for name in ("nnodes", "dist_timeout"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes = {self.nnodes}), got {self.node_rank!r}")
        if self.multihost:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"nnodes {self.nnodes} needs dist_init_addr HOST:PORT (rank 0's address), "
                                 f"got {self.dist_init_addr!r}")
        return self

    def check_spans(self, tensor_parallel_size: int) -> None:
        """ValueError unless the mesh takes every process's devices (each process must own a part of it)."""
        if self.multihost and tensor_parallel_size != jax.device_count():
            raise ValueError(f"nnodes {self.nnodes}: tensor_parallel_size must span every process's devices "
                             f"({jax.device_count()} in all), got {tensor_parallel_size}")


def initialize(dist: Distributed) -> None:
    """Join the processes (before any other jax call of this process): gloo collectives for CPU devices,
    `jax.distributed.initialize` with rank 0 as the coordinator. Again with the same layout: nothing."""
    dist.check()
    if not dist.multihost:
        return
    from jax._src import distributed
    if distributed.global_state.client is not None:
        if (jax.process_count(), jax.process_index()) != (dist.nnodes, dist.node_rank):
            raise ValueError(f"jax.distributed already joined {jax.process_count()} processes as rank "
                             f"{jax.process_index()}; asked for rank {dist.node_rank} of {dist.nnodes}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("joining %d processes as rank %d (coordinator %s)", dist.nnodes, dist.node_rank, dist.dist_init_addr)
    jax.distributed.initialize(dist.dist_init_addr, dist.nnodes, dist.node_rank,
                               heartbeat_timeout_seconds=dist.dist_timeout)


def _client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized (multihost.initialize)")
    return client


def to_host(x) -> np.ndarray:
    """A device array as a host array, from this process's own copy when the array spans other processes
    (it must then be replicated: a host read never starts a collective of its own)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if not x.sharding.is_fully_replicated:
        raise ValueError(f"a host read of an array split over processes ({x.sharding}); steps replicate "
                         f"what the host reads")
    return np.asarray(x.addressable_data(0))


def host_args(args):
    """A device call's arguments as host arrays (what is published, and what every rank runs on)."""
    return jax.tree.map(to_host, args)


class CallChannel:
    """Rank 0 -> the other ranks: every device call, in order, through the coordination service's key-value
    store, under this engine's own key prefix. Followers acknowledge every ACK_EVERY-th call, and rank 0 waits
    for those acknowledgements before it deletes older calls, so no follower can miss one. `send_seconds` /
    `calls`: rank 0's time spent publishing and the calls published. After `close` a send raises."""

    def __init__(self):
        self.client = _client()
        self.prefix = f"{PREFIX}/{next(_ENGINES)}"
        self.seq = 0
        self.send_seconds = 0.0
        self.closed = False
        self._lock = threading.Lock()            # the engine thread's sends vs close from another thread

    def send(self, kind: str, args=()) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError("this multi-host engine is closed: its followers have stopped")
            t0 = time.perf_counter()
            self._publish(kind, args)
            self.send_seconds += time.perf_counter() - t0
            if kind == STOP:
                self.closed = True

    def _publish(self, kind: str, args) -> None:
        blob = pickle.dumps((kind, args), protocol=pickle.HIGHEST_PROTOCOL)
        parts = [blob[i:i + PART_BYTES] for i in range(0, len(blob), PART_BYTES)] or [b""]
        key = f"{self.prefix}/{self.seq}"
        for i, part in enumerate(parts[1:], 1):           # the parts first: the head's arrival means all are there
            self.client.key_value_set_bytes(f"{key}/{i}", part)
        self.client.key_value_set_bytes(key, len(parts).to_bytes(4, "little") + parts[0])
        if self.seq >= ACK_EVERY and self.seq % ACK_EVERY == 0:     # every follower has read call seq - ACK_EVERY
            for rank in range(1, jax.process_count()):
                ack = f"{self.prefix}/ack/{rank}/{self.seq - ACK_EVERY}"
                self.client.blocking_key_value_get(ack, 3_600_000)
                self.client.key_value_delete(ack)
        if self.seq >= KEEP_CALLS:
            self.client.key_value_delete(f"{self.prefix}/{self.seq - KEEP_CALLS}")
        self.seq += 1

    @property
    def calls(self) -> int:
        return self.seq

    def receive(self):
        """The next call (kind, args), waiting for it as long as rank 0 lives."""
        key = f"{self.prefix}/{self.seq}"
        while True:
            try:
                head = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:                          # noqa: BLE001 — a timeout: rank 0 is idle
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise RuntimeError(f"rank {jax.process_index()}: lost rank 0's coordination service: {e}") from e
        n = int.from_bytes(head[:4], "little")
        blob = head[4:] + b"".join(self.client.blocking_key_value_get_bytes(f"{key}/{i}", POLL_MS * 10)
                                   for i in range(1, n))
        if self.seq % ACK_EVERY == 0:
            self.client.key_value_set(f"{self.prefix}/ack/{jax.process_index()}/{self.seq}", "1")
        self.seq += 1
        return pickle.loads(blob)


_agreements: dict[str, int] = {}     # name -> agreements made so far (every rank makes them in the same order)


def min_over_processes(name: str, value: int) -> int:
    """The smallest of every process's `value` (e.g. free memory), so sizing agrees across ranks."""
    if jax.process_count() == 1:
        return value
    client, me = _client(), jax.process_index()
    n = _agreements[name] = _agreements.get(name, -1) + 1          # the n-th such agreement of this process
    client.key_value_set(f"atlas_jax/min/{name}/{n}/{me}", str(int(value)))
    return min(int(client.blocking_key_value_get(f"atlas_jax/min/{name}/{n}/{r}", 600_000))
               for r in range(jax.process_count()))


def check_agree(name: str, text: str) -> None:
    """ValueError on a rank whose `text` (e.g. the resolved engine configuration) differs from rank 0's."""
    if jax.process_count() == 1:
        return
    n = _agreements[name] = _agreements.get(name, -1) + 1
    client, key = _client(), f"atlas_jax/agree/{name}/{n}"
    if jax.process_index() == 0:
        client.key_value_set(key, text)
        return
    theirs = client.blocking_key_value_get(key, 600_000)
    if theirs != text:
        raise ValueError(f"rank {jax.process_index()}'s {name} differs from rank 0's (give every rank the same "
                         f"arguments; size pools explicitly with num_pages / max_num_seqs):\n  rank 0: {theirs}\n"
                         f"  rank {jax.process_index()}: {text}")
