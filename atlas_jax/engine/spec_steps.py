"""The speculative half of EngineCore's step: drafts for a plan, a verify step, and its bookkeeping.

Module functions over the core (its proposer, runner, scheduler, spec_stats, containment): core.py keeps
the step's schedule -> dispatch -> resolve and calls these when a decoding row has drafts or is behind a
verify row in flight. A verify row's host bookkeeping at dispatch counts its fed token only (num_cached,
`pending`) and its drafts as `slack`; at resolve the accepted ones move num_cached. With MTP and async
scheduling the next row is dispatched before that (a chase row, resolved on the device: steps.chase).
Rows without drafts in a verify step get the plain sample.
"""
from __future__ import annotations

from .plan import SchedulerOutput
from .row import RowInput, row_logprobs
from .runner import Launched
from .sequence import Sequence
from .speculative import draft_room


def drafts_for(core, plan: SchedulerOutput) -> list[list[int]]:
    """Drafts per decoding sequence of the plan, within its draft caps."""
    caps = [plan.draft_caps.get(s, 0) for s in plan.decode]
    drafts = core.proposer.propose(plan.decode, caps)
    return [[int(t) for t in d][:c] for d, c in zip(drafts, caps)]


def needs_verify(plan: SchedulerOutput, drafts: list[list[int]]) -> bool:
    """A verify step: some row has drafts, or is behind a verify row in flight (its position is on the device)."""
    return any(drafts) or any(s.slack for s in plan.decode)


def launch_verify(core, plan: SchedulerOutput, rows: list[RowInput], drafts: list[list[int]]) -> Launched:
    """Dispatch one verify step over the plan's rows (decode rows first, len(drafts) of them)."""
    nd = len(drafts)
    launched = core.runner.launch_verify(rows[:nd], drafts, rows[nd:], [draft_room(s) for s in plan.decode])
    core.spec_stats.verify_steps += 1
    for seq, d in zip(plan.decode, drafts):
        seq.slack += len(d)
    return launched


def resolve_row(core, seq: Sequence, drafted: int, out: dict, i: int, touched: dict) -> None:
    """Verify row i of a resolved step reached the host: its accepted drafts and the target's token are
    appended one by one (stop checks; rows with drafts ask for no logprobs: speculative.wants_drafts)."""
    count = int(out["count"][i])
    seq.pending -= 1
    seq.slack -= drafted
    seq.num_cached += count - 1                 # the accepted drafts are cached
    if not seq.pending:
        seq.state_idx = count - 1               # ... and their recurrent state is at this position
    fed = int(out["drafted"][i])                # (device drafts: the valid ones, steps.chase)
    core.spec_stats.record_decode(1, count)
    if fed:
        core.spec_stats.record(fed, count - 1)
    logprobs = None if drafted else row_logprobs(seq, out, i)
    for tok in out["emitted"][i, :count]:
        seq.append(int(tok), logprobs)
        if seq.finished:
            break
    touched[seq.request.request_id] = seq.request
    if seq.finished:
        core.scheduler.remove(seq)
