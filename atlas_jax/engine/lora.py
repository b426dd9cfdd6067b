"""Multi-LoRA serving on the host: which adapters exist, which are in host memory, which device slot
holds which, and who is using it.

Device slots 1..max_loras hold resident adapters (slot 0 = the base model, always zeros); the pool
itself lives in the engine state (runner.py), so promoting an adapter is one compiled data update.
A running sequence holds a reference on its adapter's slot from admission to its end or
preemption (`acquire` / `release`). An adapter that is not resident is promoted into an empty slot,
else into the least recently used idle one; when every slot is busy `acquire` returns None and the
scheduler leaves the request waiting — a busy slot is never evicted.

Adapters are registered by name (LoRARequest, the server's --lora-modules, /v1/load_lora_adapter),
read from disk and validated completely when registered (weights/lora.py) and kept in an LRU host
cache of max_cpu_loras adapters; an adapter that requests in the engine use is never dropped from it.
One dropped earlier is read and validated again by the next request that names it, on that request's
thread (`lookup`), never on the engine thread: a reload that fails, or finds files other than those
registered (their sha256), refuses that request (AdapterUnavailableError), nothing else. A promotion is a
LoadAdapter op in the step's plan (plan.py); one that fails empties the slot and fails only the sequences
that asked for it (EngineCore._apply). Each
registration gets a fresh `uid`, the sequence's prefix-cache key: KV computed under one adapter is
never reused under another, nor under the same name re-registered from other files.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading

import numpy as np

from ..config import ModelConfig
from ..errors import AdapterUnavailableError, InvalidRequestError, LoRAError, UnknownAdapterError  # noqa: F401
from ..layers.lora import param_at
from ..weights.lora import LoRAAdapter, adaptable, load_peft_adapter
from .client import LoRARequest
from .plan import LoadAdapter

log = logging.getLogger("atlas_jax.engine")


@dataclasses.dataclass
class _Registered:
    request: LoRARequest
    uid: int                           # prefix-cache key of sequences under this registration
    digest: str = ""                   # its files' hash when registered (a reload must match it)
    in_use: int = 0                    # requests in the engine that name it
    pinned: int = 0                    # requests made under it and not yet gone (their host copy is kept)


class LoRAManager:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int | None):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be positive, got {max_loras}, {max_rank}")
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_cpu_loras = max_cpu_loras or max_loras
        self._lock = threading.RLock()                 # registry, host cache, slot table: request threads use them
        self._registry: dict[str, _Registered] = {}
        self._host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()   # uid -> weights, LRU
        self._uids = itertools.count(1)
        self._tick = itertools.count()
        n = max_loras + 1                              # slot 0 = the base model
        self.slot_uid = [0] + [None] * max_loras       # which registration each slot holds
        self.refcount = [0] * n
        self.last_used = [0] * n
        self.num_promotions = 0

    # ---- registry (any thread) -------------------------------------------------------------
    def register(self, req: LoRARequest) -> int:
        """Register (or look up) an adapter by name, reading it now so that a bad adapter is refused here
        (LoRAError) rather than when a request reaches the device. Returns its uid."""
        with self._lock:
            known = self._registry.get(req.lora_name)
            if known is not None and (not req.lora_path or known.request.lora_path == req.lora_path):
                return known.uid
            if known is not None and known.in_use:
                raise LoRAError(f"adapter {req.lora_name!r} is in use; it cannot be re-registered from "
                                f"{req.lora_path!r} until its requests finish")
            if not req.lora_path:
                raise UnknownAdapterError(f"adapter {req.lora_name!r} is not loaded", "model")
        adapter = self._read(req)
        with self._lock:
            if known is not None:
                self._forget(known)
            entry = self._registry[req.lora_name] = _Registered(req, next(self._uids), adapter.digest)
            self._cache(entry.uid, adapter)
            return entry.uid

    def unregister(self, name: str) -> None:
        """Forget an adapter. Refused while a request in the engine uses it."""
        with self._lock:
            entry = self._registry.get(name)
            if entry is None:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded", "lora_name")
            if entry.in_use:
                raise LoRAError(f"adapter {name!r} is in use by {entry.in_use} request(s); unload it when they end")
            self._forget(entry)
            del self._registry[name]

    def next_int_id(self) -> int:
        with self._lock:
            return 1 + max((e.request.lora_int_id for e in self._registry.values()), default=0)

    def names(self) -> list[LoRARequest]:
        with self._lock:
            return [e.request for e in self._registry.values()]

    def lookup(self, req: LoRARequest | str) -> tuple[str, int]:
        """(name, uid) of the adapter a request names, registering it when it comes with a path; every
        refusal is an InvalidRequestError (UnknownAdapterError for a name never registered). Its host copy
        is pinned until `unpin(name, uid)` (the request object's finalizer: engine/core.py)."""
        if isinstance(req, str):
            req = LoRARequest(req, 1)
        if not isinstance(req, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(req).__name__}", "lora_request")
        try:
            uid = self.register(req)
        except InvalidRequestError:
            raise
        except LoRAError as e:
            raise InvalidRequestError(str(e), "lora_request") from None
        self._host_copy(req.lora_name, uid)
        return req.lora_name, uid

    def use(self, name: str, uid: int) -> None:
        """One more queued request under registration (name, uid) until `done(name)` (its host copy is
        pinned since `lookup`); refused when the name was unloaded or re-registered since."""
        with self._lock:
            entry = self._registry.get(name)
            if entry is None or entry.uid != uid:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded", "model")
            entry.in_use += 1

    def unpin(self, name: str, uid: int) -> None:
        """A request made by `lookup` under (name, uid) is gone: its host copy may be dropped again."""
        with self._lock:
            entry = self._registry.get(name)
            if entry is not None and entry.uid == uid and entry.pinned > 0:
                entry.pinned -= 1

    def done(self, name: str) -> None:
        """A request under `name` ended (finished, aborted, failed)."""
        with self._lock:
            entry = self._registry.get(name)
            if entry is not None:
                entry.in_use -= 1

    # ---- device slots (engine thread) ------------------------------------------------------
    def acquire(self, uid: int) -> tuple[int, LoadAdapter | None] | None:
        """(a slot holding registration `uid`, with one more reference; the LoadAdapter op that fills it when
        the adapter is promoted, else None); None while every slot is busy. The slot table records the
        promotion at once; `load_failed` undoes it if the op fails."""
        if uid == 0:
            return 0, None
        with self._lock:
            load = None
            slot = next((s for s in range(1, self.max_loras + 1) if self.slot_uid[s] == uid), None)
            if slot is None:
                free = [s for s in range(1, self.max_loras + 1) if self.refcount[s] == 0]
                if not free:
                    return None
                slot = min(free, key=lambda s: (self.slot_uid[s] is not None, self.last_used[s]))  # empty, else LRU
                load = LoadAdapter(slot, uid, self._weights(uid))
                self.slot_uid[slot] = uid
                self.num_promotions += 1
            self.refcount[slot] += 1
            self.last_used[slot] = next(self._tick)
            return slot, load

    def load_failed(self, slot: int, uid: int) -> None:
        """The LoadAdapter(slot, uid) op failed: the slot holds nothing usable (its holders are failed)."""
        with self._lock:
            if self.slot_uid[slot] == uid:
                self.slot_uid[slot] = None
                self.num_promotions -= 1

    def release(self, slot: int) -> None:
        if slot == 0:
            return
        with self._lock:
            if self.refcount[slot] <= 0:
                raise ValueError(f"adapter slot {slot} released but not held")
            self.refcount[slot] -= 1

    def resident(self) -> dict[int, str | None]:
        """slot -> adapter name (None: empty) for slots 1..max_loras."""
        with self._lock:
            by_uid = {e.uid: n for n, e in self._registry.items()}
        return {s: by_uid.get(self.slot_uid[s]) for s in range(1, self.max_loras + 1)}

    # ---- host cache --------------------------------------------------------------------------
    def _read(self, req: LoRARequest) -> LoRAAdapter:
        return load_peft_adapter(req.lora_path, self.cfg, self.max_rank, req.lora_name)

    def _cache(self, uid: int, adapter: LoRAAdapter) -> None:
        """Keep `adapter`; drop the least recently used copies past max_cpu_loras, never one in use."""
        self._host[uid] = adapter
        self._host.move_to_end(uid)
        busy = {e.uid for e in self._registry.values() if e.in_use or e.pinned}
        for old in [u for u in self._host if u not in busy and u != uid]:
            if len(self._host) <= self.max_cpu_loras:
                break
            del self._host[old]

    def _host_copy(self, name: str, uid: int) -> None:
        """Pin registration uid's validated weights in host memory, read again (and validated) if they were
        dropped: on the calling request's thread. AdapterUnavailableError when the files no longer load
        (the log has the path; the message, which reaches clients, does not)."""
        with self._lock:
            entry = self._registry.get(name)
            if entry is None or entry.uid != uid:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded", "model")
            if uid in self._host:
                entry.pinned += 1
                self._host.move_to_end(uid)
                return
        try:
            adapter = self._read(entry.request)
        except LoRAError as e:
            log.error("adapter %r could not be reloaded from %s: %s", name, entry.request.lora_path, e)
            raise AdapterUnavailableError(f"adapter {name!r} could not be reloaded: its files no longer load "
                                          "(the server log says why)") from None
        if adapter.digest != entry.digest:
            log.error("adapter %r changed on disk (%s) since it was loaded", name, entry.request.lora_path)
            raise AdapterUnavailableError(f"adapter {name!r} changed on disk since it was loaded; unload and load it "
                                          "again to serve the new files")
        with self._lock:
            if self._registry.get(name) is not entry:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded", "model")
            entry.pinned += 1
            self._cache(uid, adapter)

    def _weights(self, uid: int) -> dict:
        """An adapter's validated host copy (kept while requests in the engine use it)."""
        with self._lock:
            adapter = self._host.get(uid)
            if adapter is None:
                raise AdapterUnavailableError(f"adapter registration {uid} has no host copy")
            self._host.move_to_end(uid)
        return adapter.weights

    def _forget(self, entry: _Registered) -> None:
        self._host.pop(entry.uid, None)
        for s in range(1, self.max_loras + 1):
            if self.slot_uid[s] == entry.uid and self.refcount[s] == 0:
                self.slot_uid[s] = None


def pool_shapes(cfg: ModelConfig, params) -> dict[str, tuple[int, int]]:
    """'dotted.param.path' -> (in, out) of every adaptable projection these params hold."""
    return {key: tuple(np.shape(param_at(params, key))) for key in adaptable(cfg).values()}
