"""The speculative half of EngineCore's step: drafts for a plan, a verify step, and its bookkeeping.

Module functions over the core (its proposer, runner, scheduler, spec_stats, containment): core.py keeps
the plain step's schedule -> dispatch -> resolve and calls these when a decoding row has drafts. A verify
step is synchronous (speculation turns async scheduling off); rows without drafts in it get the plain sample.
"""
from __future__ import annotations

from .row import RowInput
from .plan import SchedulerOutput
from .sequence import Sequence


def drafts_for(core, plan: SchedulerOutput) -> list[list[int]]:
    """Drafts per decoding sequence of the plan, within its draft caps."""
    caps = [plan.draft_caps.get(s, 0) for s in plan.decode]
    drafts = core.proposer.propose(plan.decode, caps)
    return [[int(t) for t in d][:c] for d, c in zip(drafts, caps)]


def run_verify(core, work: list, rows: list[RowInput], drafts: list[list[int]], touched: dict) -> None:
    """One verify step over `work` (decode rows first, len(drafts) of them, then prefill rows)."""
    nd = len(drafts)
    emitted, out = core.runner.verify(rows[:nd], drafts, rows[nd:])
    core.spec_stats.verify_steps += 1
    keep_drafts(core, [s for s, _ in work], [r.draft_ok for r in rows])
    core.num_steps += 1
    core.spec_stats.record_decode(nd, sum(map(len, emitted)))
    for i, (seq, n) in enumerate(work):
        if i < nd and drafts[i]:
            core._contain(seq, touched, lambda: _accept(core, seq, drafts[i], emitted[i], touched))
        else:
            core._contain(seq, touched, lambda: _advance(core, seq, n, out, i, touched))


def keep_drafts(core, seqs: list[Sequence], draft_ok: list[bool]) -> None:
    """MTP: the drafts this step made for each row, to verify next step."""
    drafts = core.runner.last_drafts
    for i, (seq, ok) in enumerate(zip(seqs, draft_ok)):
        seq.pending_drafts = [int(t) for t in drafts[i]] if drafts is not None and ok else []


def _accept(core, seq: Sequence, drafts: list[int], toks: list[int], touched: dict) -> None:
    """After a verify row with drafts: its accepted drafts and the target's token, appended one by one
    (rows with drafts ask for no logprobs: speculative.wants_drafts)."""
    accepted = len(toks) - 1
    core.spec_stats.record(len(drafts), accepted)
    seq.num_cached += 1 + accepted              # the fed token and the accepted drafts are cached
    seq.state_idx = accepted                    # ... and their recurrent state is at this position
    for tok in toks:
        seq.append(tok, None)
        if seq.finished:
            break
    touched[seq.request.request_id] = seq.request
    if seq.finished:
        core.scheduler.remove(seq)
    else:
        core.scheduler.progressed(seq)


def _advance(core, seq: Sequence, n: int, out: dict, i: int, touched: dict) -> None:
    """After a synchronous plain row of n tokens (a verify step's rows without drafts)."""
    if core._dispatched(seq, n):
        core._emit(seq, out, i, touched)
    if not seq.finished:
        core.scheduler.progressed(seq)
