"""EngineClient: what a frontend (the HTTP server) needs of an engine, and the request vocabulary it
shares with it. `AsyncLLM` implements it; the server imports nothing else of the engine (an
import-linter contract), so another engine (a process-separated core, a test double) can serve it.
Host-only: no jax."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: a name, a positive integer id, and the adapter's directory (PEFT format)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be a positive integer, got {self.lora_int_id!r}")

    name = property(lambda self: self.lora_name)
    adapter_id = property(lambda self: self.lora_int_id)
    path = property(lambda self: self.lora_path)


class _Finished:  # noqa: N801
    """Sentinel on a request stream: no more outputs."""


FINISHED = _Finished     # the end-of-stream sentinel on a request's output queue


class EngineClient(Protocol):
    """The serving interface. Outputs of a request arrive on the asyncio.Queue `add_request_async`
    returns: RequestOutputs, then FINISHED, or an exception (ValueError: refused; RequestFailedError:
    this request failed; EngineDeadError: the engine is down)."""
    tokenizer: Any                      # frontend.tokenizer.Tokenizer, or None (token-id prompts only)
    model_path: str
    max_model_len: int
    vocab_size: int
    num_pages: int                      # KV pages in the pool
    num_slots: int                      # recurrent-state slots (running sequences)
    loras: Any                          # engine.lora.LoRAManager (register / unregister / names), or None
    is_running: bool
    is_ready: bool                      # running and warmed up
    is_draining: bool
    errored: BaseException | None
    num_in_flight: int

    def stats(self) -> dict:
        """running / waiting / swapped, free pages and slots, compiles, failures, aborts by reason,
        prefix_cache (None when off), spec (None without speculation), lora."""

    async def add_request_async(self, prompt, params, request_id: str | None = None, lora_request=None,
                                client: str | None = None) -> tuple[Any, asyncio.Queue]:
        """Validate and queue a request (off the event loop); its output queue."""

    def abort_nowait(self, request_id: str, reason: str = "abort") -> None:
        """End a request (its stream gets its last output and FINISHED)."""

    async def offload(self, fn, *args):
        """fn(*args) on the engine's worker pool (heavy host work off the event loop)."""
