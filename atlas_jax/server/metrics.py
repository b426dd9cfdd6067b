"""Prometheus metrics of the server and the engine behind it (one registry per app)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ROUTES = {"/health", "/metrics", "/v1/models", "/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions"}


def path_label(path: str) -> str:
    """Metrics label: known routes by name, anything else as "other" (bounded label set)."""
    return path if path in ROUTES else "other"


class Metrics:
    def __init__(self, engine):
        """engine: an EngineClient (engine/client.py); gauges read its stats() when scraped."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("atlas_requests", "Finished HTTP requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("atlas_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("atlas_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("atlas_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("atlas_inter_token_latency_seconds", "Time between streamed outputs", registry=r,
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        gauge = lambda name, doc, key: Gauge(name, doc, registry=r).set_function(lambda: engine.stats()[key])
        gauge("atlas_running_requests", "Sequences running", "running")
        gauge("atlas_waiting_requests", "Sequences waiting", "waiting")
        gauge("atlas_swapped_requests", "Sequences swapped to host", "swapped")
        gauge("atlas_free_kv_pages", "Free KV pages", "free_pages")
        gauge("atlas_free_state_slots", "Free recurrent-state slots", "free_slots")
        gauge("atlas_failed_requests", "Requests the engine failed alone (step containment)", "num_failed_requests")
        gauge("atlas_num_compiles", "Compiled executables (constant once warm-up is done)", "num_compiles")
        gauge("atlas_warmup_pending", "Step shapes warm-up has yet to compile (served padded meanwhile)",
              "warmup_pending")
        Gauge("atlas_kv_pages", "KV pages in the pool", registry=r).set(engine.num_pages)
        Gauge("atlas_state_slots", "Recurrent-state slots", registry=r).set(engine.num_slots)
        Gauge("atlas_aborted_requests", "Requests ended before their finish (client gone: abort)", registry=r
              ).set_function(lambda: engine.stats()["num_aborted"].get("abort", 0))
        Gauge("atlas_kv_usage_ratio", "Share of KV pages in use", registry=r).set_function(
            lambda: 1 - engine.stats()["free_pages"] / engine.num_pages)
        if engine.stats()["prefix_cache"] is not None:
            cache = lambda key: engine.stats()["prefix_cache"][key]
            for key, doc in (("query_tokens", "Prompt tokens looked up in the prefix cache"),
                             ("hit_tokens", "Prompt tokens served from the prefix cache"),
                             ("hit_rate", "Prefix cache hit rate in tokens (hit / query)"),
                             ("cached_pages", "KV pages registered in the prefix cache"),
                             ("idle_pages", "Cached KV pages no sequence holds (evictable)"),
                             ("evicted_pages", "Cached KV pages evicted"),
                             ("snapshots", "Recurrent-state snapshots held"),
                             ("snapshot_bytes", "Bytes of recurrent-state snapshots held"),
                             ("evicted_snapshots", "Recurrent-state snapshots evicted")):
                Gauge(f"atlas_prefix_cache_{key}", doc, registry=r).set_function(lambda key=key: cache(key))
        if engine.stats()["spec"] is not None:
            spec = lambda key: engine.stats()["spec"][key] or 0.0
            for key, doc in (("drafted", "Draft tokens verified"), ("accepted", "Draft tokens accepted"),
                             ("verify_steps", "Target steps that verified drafts"),
                             ("acceptance_rate", "Accepted / drafted tokens"),
                             ("mean_accepted_length", "Tokens emitted per verified row (1 + accepted drafts)"),
                             ("tokens_per_target_step", "Tokens per decoding row per target step")):
                Gauge(f"atlas_spec_{key}", doc, registry=r).set_function(lambda key=key: spec(key))

    def observe(self, out) -> None:
        """Per delta output: new tokens of every completion (all n); at the finish: prompt tokens, TTFT."""
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        if out.finished and out.metrics is not None:
            self.prompt_tokens.inc(out.metrics.num_prompt_tokens)
            if out.metrics.time_to_first_token is not None:
                self.ttft.observe(out.metrics.time_to_first_token)
