"""EngineCore's read-outs and prefix-cache controls: stats for /metrics and LLM, LoRA slot tables,
prefix-cache hit rates, and turning the cache off / on / empty (only while idle)."""
from __future__ import annotations

from ..state.cache import snapshot_bytes


class EngineIntrospection:
    """Mixed into EngineCore: reads its scheduler, allocators, runner, prefix cache and LoRA manager."""

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    def stats(self) -> dict:
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "swapped": len(s.swapped),
                "free_pages": self.blocks.num_free, "num_pages": self.num_pages, "free_slots": self.slots.num_free,
                "num_slots": self.slots.capacity, "num_preemptions": dict(s.num_preemptions),
                "num_compiles": self.num_compiles, "warmup_pending": self.runner.exes.pending,
                "num_steps": self.num_steps, "num_overlapped": self.num_overlapped,
                "step_seconds": self.step_seconds, "wait_seconds": self.runner.wait_seconds,
                "num_failed_requests": self.num_failed_requests, "num_aborted": dict(self.num_aborted),
                "prefix_cache": self.prefix_cache_stats(), "lora": self.lora_stats()}

    def lora_stats(self) -> dict | None:
        """Adapter slots (slot -> resident adapter name), their reference counts, promotions; None without LoRA."""
        if self.lora is None:
            return None
        return {"slots": self.lora.resident(), "refcounts": self.lora.refcount[1:],
                "num_promotions": self.lora.num_promotions, "adapters": [r.lora_name for r in self.lora.names()]}

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (idle pages back to the free list, snapshots dropped)."""
        if self.prefix_cache is not None:
            self.blocks.take_back(self.prefix_cache.reset())

    def set_prefix_caching(self, on: bool) -> None:
        """Turn lookups, registration and forks on or off on an engine built with prefix caching
        (A/B runs on one set of compiled steps: benchmarks, tests). Only while idle; the cache
        starts empty either way."""
        if self.prefix_cache is None:
            raise ValueError("this engine was built without enable_prefix_caching")
        if self.scheduler.has_work():
            raise RuntimeError("set_prefix_caching needs an idle engine")
        self.reset_prefix_cache()
        self.scheduler.cache = self.prefix_cache if on else None

    def prefix_cache_stats(self) -> dict | None:
        """Token hit rate, cached / idle pages, snapshots (count, bytes), evictions; None when off."""
        c = self.prefix_cache
        if c is None:
            return None
        st = dict(c.stats)
        st["hit_rate"] = st["hit_tokens"] / st["query_tokens"] if st["query_tokens"] else 0.0
        st.update(cached_pages=c.num_nodes(), idle_pages=c.num_idle, snapshots=c.num_snapshots_used,
                  snapshot_slots=c.num_snapshots,
                  snapshot_bytes=c.num_snapshots_used * snapshot_bytes(self.cfg, self.runner.dtype))
        return st
