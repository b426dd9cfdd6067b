"""Failure containment around EngineCore's step: a plan's state ops, and a failed plan's rows run alone.

Only failures before the device ran are contained here (the donated state survived: `runner.state_lost()` is
False); a request whose own work raises fails alone (finish_reason "error"), the rest go on.
"""
from __future__ import annotations

from ..errors import AdapterUnavailableError
from .plan import LoadAdapter, SchedulerOutput
from .request import Request


def apply_ops(core, plan: SchedulerOutput) -> list[Request]:
    """Apply the plan's state ops in order. Contained: an adapter that could not be acquired while
    scheduling, or whose LoadAdapter op raises (before the device ran), fails the requests that
    asked for it; their siblings leave the plan with them. Anything else, or a lost state, raises."""
    failures, core.scheduler.failed = list(core.scheduler.failed), []
    for op in plan.ops:
        try:
            core.runner.state_ops.apply(op)
        except Exception as e:
            if not isinstance(op, LoadAdapter) or core.runner.state_lost():
                raise
            core.lora.load_failed(op.slot, op.uid)
            error = AdapterUnavailableError(f"adapter slot {op.slot} could not be loaded: {e!r}")
            failures += [(s, error) for s in core.scheduler.running
                         if s.adapter_slot == op.slot and s.cache_key == op.uid]
    touched = {}
    for seq, e in failures:
        if seq.request.request_id in core.requests:
            touched[seq.request.request_id] = core._fail(seq.request, e)
    plan.decode = [s for s in plan.decode if not s.finished]
    plan.prefill = [(s, n) for s, n in plan.prefill if not s.finished]
    return list(touched.values())


def isolate(core, plan: SchedulerOutput, touched: dict) -> None:
    """Run each sequence of a failed plan alone (synchronously); fail the requests whose own step raises."""
    for seq, n in [(s, 1) for s in plan.decode] + plan.prefill:
        if seq.finished or seq not in core.scheduler.running:
            continue                                  # failed with a sibling, or preempted
        solo = SchedulerOutput(decode=[seq] if n == 1 else [], prefill=[] if n == 1 else [(seq, n)],
                               draft_ok=plan.draft_ok)
        try:
            core._run(solo, touched, speculate=False)
            if core.inflight is not None:
                core._resolve(touched)
        except Exception as e:
            if core.runner.state_lost():
                raise
            touched[seq.request.request_id] = core._fail(seq.request, e)
