"""The device side of a step: pure functions the runner compiles per shape bucket.

Each takes (params, state, ...) and returns (outputs, new state); the state is donated, so
pools are updated in place. With an MTP drafter (`mtp_drafts` > 0) every step also catches the
MTP head up on the positions the step made permanent and drafts the next tokens (models/mtp.py);
`mtp_in` = (next_tokens per segment [B, T]: the token after each fed position where the host
knows it, -1 where it is the token this step emits; draft_ok [sum B]). With ngram on the device
(`ngram`, a device_ngram.NgramSpec) every step records its tokens in the slots' history and looks
the next drafts up there. Either way the drafts stay on the device (`last_drafts`), as do the self
drafter's (`self_draft_step`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..models import mtp
from . import device_ngram
from ..layers.lora import with_pool
from ..models.decoder import argmax, forward, last_positions, lm_head
from ..state.cache import ModelState
from .sampler import PenaltyState, SamplingInput, SlotSampling, record_fed_tokens, sample, verify
from .sequence import DRAFT, PENDING


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineState:
    model: ModelState
    penalties: PenaltyState
    draft_kv: tuple = ()       # the MTP head's (k, v) page pools per MTP layer (empty without MTP)
    snapshots: tuple = ()      # prefix cache: per GDN layer (h [N, Hv, Dk, Dv] fp32, conv [N, C, K]) recurrent
                               # state after a cached prefix (state/prefix_cache.py); empty when off
    lora: dict = dataclasses.field(default_factory=dict)   # LoRA pool: param key -> (A [in, S, R], B [S, R, out]),
                               # slot 0 zeros (layers/lora.py, engine/lora.py); empty without LoRA
    last_tokens: jax.Array | None = None   # [S] i32 each slot's last sampled token: what a PENDING (< 0) token
                               # fed by the next step is (async scheduling: the host reads it a step late)
    last_drafts: jax.Array | None = None   # device drafters (MTP, self, ngram): [S, D] i32 the drafts made for
                               # each slot's next verify row, -1 past its valid ones: what its DRAFT (-2) tokens
                               # are (drafts never reach the host)
    last_accept: jax.Array | None = None   # device drafters: [S] i32 drafts each slot's last verify row accepted:
                               # what a chase row (state_idx < 0: the host has not read it yet) moves by
    sampling: SlotSampling | None = None   # the persistent batch: each slot's sampling parameters [S + 1]
                               # (sampler.SlotSampling), rewritten only where a step's SamplingInput says
    history: jax.Array | None = None   # ngram on the device: [S, L] i32 each slot's tokens by position, valid
                               # below its sequence's length (device_ngram.py)


def fill_pending(segments, last_tokens):
    """Segments with each PENDING (-1) token replaced by its row's slot's last sampled token."""
    if last_tokens is None:
        return segments
    return tuple(dataclasses.replace(seg, tokens=jnp.where(
        seg.tokens == PENDING, jnp.take(last_tokens, seg.slot, mode="clip")[:, None], seg.tokens)) for seg in segments)


def chase(state: EngineState, seg, sampling, drafts, room):
    """A verify segment [B, K] resolved against what the slots' last steps left on the device.

    DRAFT tokens (and their `drafts` columns) become the slot's last drafts. A chase row (state_idx < 0)
    was built by the host before its previous verify row's acceptance was known, as if it accepted
    none: it moves by that row's accepted count a (start, sampling step, state position a) and keeps
    at most room - a drafts (room: the drafts the row may verify before its request's length limit,
    counted without a), and at most the leading valid (>= 0) drafts the device holds. Returns (seg, sampling
    over the B rows, drafts [B, K], -1 where none)."""
    b, k = seg.tokens.shape
    if state.last_drafts is None:
        return seg, sampling, drafts
    col = jnp.arange(k)[None, :]
    held = jnp.take(state.last_drafts, seg.slot, axis=0, mode="clip")[:, :k - 1]
    held = jnp.pad(held, ((0, 0), (1, k - held.shape[1] - 1)))                  # column j + 1 = draft j
    tokens = jnp.where(seg.tokens == DRAFT, held, seg.tokens)
    drafts = jnp.where(drafts == DRAFT, jnp.pad(held[:, 1:], ((0, 0), (0, 1))), drafts)
    chased = seg.state_idx < 0
    a = jnp.where(chased, jnp.take(state.last_accept, seg.slot, mode="clip"), 0)
    ready = jnp.sum(jnp.cumprod(held[:, 1:] >= 0, axis=1), axis=1)         # the device's drafts (ngram: some -1)
    cap = jnp.clip(jnp.minimum(seg.q_len - 1, room - a), 0)
    cap = jnp.where(seg.tokens[:, 1] == DRAFT, jnp.minimum(cap, ready), cap)
    drafts = jnp.where(col < cap[:, None], drafts, -1)
    seg = dataclasses.replace(seg, tokens=jnp.where(col <= cap[:, None], tokens, 0), start=seg.start + a,
                              q_len=jnp.where(seg.q_len > 0, 1 + cap, 0), state_idx=jnp.where(chased, a, seg.state_idx))
    return seg, dataclasses.replace(sampling, step=sampling.step + a), drafts


def record_sampled(state: EngineState, sampling, tokens, drafts=None, accepted=None) -> dict:
    """EngineState fields after a step: per row's slot its last sampled token, (MTP) the drafts it made and
    the drafts it accepted (padding rows' out-of-range slot: dropped)."""
    put = lambda pool, x: None if pool is None else pool.at[sampling.slot].set(x, mode="drop")
    return {"last_tokens": put(state.last_tokens, tokens),
            "last_drafts": state.last_drafts if drafts is None else put(state.last_drafts, drafts),
            "last_accept": put(state.last_accept, jnp.zeros_like(tokens) if accepted is None else accepted)}


def _params(params, state: EngineState):
    """The weights a forward sees: the params with the resident LoRA adapters merged in."""
    return with_pool(params, state.lora)


def step(cfg, kernels, mtp_drafts, ngram, params, state: EngineState, segments, sampling_in: SamplingInput,
         prompt_lens, mtp_in):
    """Decode rows and prefill chunks; one sampled token per row (+ MTP or ngram drafts: `ngram` a
    device_ngram.NgramSpec, or None)."""
    columns, sampling = sampling_in.resolve(state.sampling)
    segments = fill_pending(segments, state.last_tokens)
    penalties = record_fed_tokens(state.penalties, segments, prompt_lens)
    logits, hidden, model = forward(_params(params, state), state.model, segments, cfg, kernels=kernels,
                                    all_hidden=mtp_drafts > 0)
    out = sample(logits, sampling, penalties)
    drafts, draft_kv, history = None, state.draft_kv, state.history
    if mtp_drafts:
        next_tokens, draft_ok = mtp_in
        emitted, offset, tokens = out.tokens, 0, []
        for seg, nt in zip(segments, next_tokens):
            b = seg.tokens.shape[0]
            tokens.append(jnp.where(nt >= 0, nt, emitted[offset:offset + b, None]))
            offset += b
        drafts, draft_kv = mtp.propose(params, draft_kv, segments, tokens, hidden, [s.q_len for s in segments],
                                       draft_ok, cfg, mtp_drafts, kernels)
    if ngram is not None:
        ends = jnp.concatenate([seg.start + seg.q_len for seg in segments])
        live = jnp.concatenate([(seg.q_len > 0).astype(jnp.int32) for seg in segments])
        history, drafts = device_ngram.advance(history, segments, out.tokens[:, None], ends, live, ngram)
    return (out, drafts), dataclasses.replace(state, model=model, penalties=penalties, draft_kv=draft_kv,
                                              sampling=columns, history=history,
                                              **record_sampled(state, sampling, out.tokens, drafts))


def verify_step(cfg, kernels, mtp_drafts, ngram, params, state: EngineState, segments, sampling_in: SamplingInput,
                prompt_lens, drafts, room, mtp_in):
    """A [B, K] segment of rows feeding (last token, drafts...), optionally followed by a prefill
    segment [Bp, Tp] (a mixed step); PENDING / DRAFT tokens and chase rows are resolved first (`chase`).
    The plain sample at each verify row's position 0 (for rows without drafts: penalties, logprobs)
    and at each prefill row's last token (sampling covers the B verify rows then the prefill rows),
    the acceptance test at every verify position, and MTP drafts for the next step (from each verify
    row's accepted position; or ngram drafts from each row's new context). Returns (first: the plain
    samples, emitted [B, K]: each verify row's tokens (its accepted drafts, then the target's; -1 after
    them), count [B], drafted [B]: the drafts each row fed, new drafts or None)."""
    columns, sampling = sampling_in.resolve(state.sampling)
    seg = segments[0]
    b, k = seg.tokens.shape
    seg, verify_sampling, drafts = chase(state, seg, jax.tree.map(lambda x: x[:b], sampling), drafts, room)
    sampling = jax.tree.map(lambda v, x: jnp.concatenate([v, x[b:]]), verify_sampling, sampling)
    segments = fill_pending((seg,) + tuple(segments[1:]), state.last_tokens)
    seg = segments[0]
    penalties = record_fed_tokens(state.penalties, segments, prompt_lens)
    _, hidden, model = forward(_params(params, state), state.model, segments, cfg, kernels=kernels, all_hidden=True,
                               logits=False)
    logits = lm_head(params, hidden[:b * k], cfg).reshape(b, k, -1)
    firsts = [logits[:, 0]]
    if len(segments) > 1:
        firsts.append(lm_head(params, last_positions(hidden[b * k:], segments[1:]), cfg))
    first = sample(jnp.concatenate(firsts), sampling, penalties)
    accepted, last, run, emitted = _runs(seg, drafts, *verify(logits, drafts, verify_sampling), first.tokens[:b])
    new_drafts, draft_kv, history = _drafts_after_verify(cfg, kernels, mtp_drafts, ngram, params, state, segments,
                                                         hidden, run, emitted, accepted, first.tokens[b:], mtp_in)
    pad = jnp.zeros((first.tokens.shape[0] - b,), jnp.int32)
    written = record_sampled(state, sampling, jnp.concatenate([last, first.tokens[b:]]), new_drafts,
                             jnp.concatenate([accepted.astype(jnp.int32), pad]))
    drafted = jnp.sum(drafts >= 0, axis=1).astype(jnp.int32)
    return (first, emitted, accepted + 1, drafted, new_drafts), dataclasses.replace(
        state, model=model, penalties=penalties, draft_kv=draft_kv, sampling=columns, history=history, **written)


def _runs(seg, drafts, target, accept, first):
    """A verify segment's outcome: (accepted [B]: leading accepted drafts, last [B]: the target's own token,
    run [B, K]: the next token after each fed position, emitted [B, K]: the row's tokens, -1 after them)."""
    k = seg.tokens.shape[1]
    accepted = jnp.sum(jnp.cumprod(accept & (drafts >= 0), axis=1), axis=1)
    col = jnp.arange(k)[None, :]
    last = jnp.where(drafts[:, 0] >= 0, jnp.take_along_axis(target, accepted[:, None], axis=1)[:, 0], first)
    run = jnp.where(col < accepted[:, None], jnp.roll(seg.tokens, -1, axis=1), last[:, None])
    return accepted, last, run, jnp.where(col <= accepted[:, None], run, -1)


def _drafts_after_verify(cfg, kernels, mtp_drafts, ngram, params, state: EngineState, segments, hidden, run, emitted,
                         accepted, sampled, mtp_in):
    """(the next step's drafts or None, the MTP head's KV, the ngram history) after a verify step: from each
    verify row's accepted position (`_runs`) and each prefill row's sample `sampled` [Bp]."""
    seg, rest = segments[0], segments[1:]
    catch = jnp.where(seg.q_len > 0, accepted + 1, 0)
    if mtp_drafts:
        next_tokens, draft_ok = mtp_in
        tokens, counts = [run], [catch]
        if rest:
            tokens.append(jnp.where(next_tokens[1] >= 0, next_tokens[1], sampled[:, None]))
            counts.append(rest[0].q_len)
        drafts, draft_kv = mtp.propose(params, state.draft_kv, segments, tokens, hidden, counts, draft_ok, cfg,
                                       mtp_drafts, kernels)
        return drafts, draft_kv, state.history
    if ngram is not None:                        # verify rows emit from start + 1, prefill rows after their chunk
        k = emitted.shape[1]
        runs = jnp.concatenate([emitted, jnp.pad(sampled[:, None], ((0, 0), (0, k - 1)), constant_values=-1)])
        at = jnp.concatenate([seg.start + 1] + [s.start + s.q_len for s in rest])
        count = jnp.concatenate([catch] + [(s.q_len > 0).astype(jnp.int32) for s in rest])
        history, drafts = device_ngram.advance(state.history, segments, runs, at, count, ngram)
        return drafts, state.draft_kv, history
    return None, state.draft_kv, state.history


def self_draft_step(cfg, kernels, num_drafts, params, state: EngineState, segment, caps, room):
    """Self-speculative drafts: the model without its recurrent layers, fed the row's last token and
    then its own greedy drafts, num_drafts times, into the slots' last drafts (-1 past a row's cap), where
    its verify row reads them (DRAFT). It writes attention KV at positions start .. start + cap - 1 (the
    verify step rewrites them with the full model's); GDN state is untouched. segment [B, 1] (PENDING
    tokens from the slots' last tokens; a chase row starts its previous verify row's accepted count a
    later and keeps at most room - a drafts, as in `chase`); caps [B] drafts wanted per row."""
    (segment,) = fill_pending((segment,), state.last_tokens)
    a = jnp.where(segment.state_idx < 0, jnp.take(state.last_accept, segment.slot, mode="clip"), 0)
    caps = jnp.clip(jnp.minimum(caps, room - a), 0)
    model, tok, drafts = state.model, segment.tokens[:, 0], []
    for j in range(num_drafts):
        seg = dataclasses.replace(segment, tokens=tok[:, None], start=segment.start + a + j,
                                  q_len=jnp.where((segment.q_len > 0) & (j < caps), 1, 0))
        logits, _, model = forward(_params(params, state), model, (seg,), cfg, kernels=kernels, skip_recurrent=True)
        tok = argmax(logits)
        drafts.append(tok)
    drafts = jnp.where(jnp.arange(num_drafts)[None, :] < caps[:, None], jnp.stack(drafts, axis=1), -1)
    last_drafts = state.last_drafts.at[segment.slot].set(drafts, mode="drop")
    return drafts, dataclasses.replace(state, model=model, last_drafts=last_drafts)


def logits_step(cfg, kernels, params, state: EngineState, segments):
    logits, _, model = forward(_params(params, state), state.model, segments, cfg, all_logits=True, kernels=kernels)
    return logits, dataclasses.replace(state, model=model)


def score_step(cfg, kernels, top, params, state: EngineState, segments, targets):
    """Prompt scoring on the device: per fed position the logprob of targets[b, t] (the next prompt token)
    and the `top` best (ids, logprobs). Only these leave the device, never the [T, V] logits."""
    (logits,), state = logits_step(cfg, kernels, params, state, segments)     # one segment
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp, top)
    return (jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], top_ids, top_lp), state


def save_pages(params, state: EngineState, pages):
    """Copy of KV pages `pages` [C] in every pool (target and MTP): swap-out, one chunk of a sequence's pages."""
    del params
    return tuple((k[pages], v[pages]) for k, v in state.model.kv + state.draft_kv), state


def save_slot(params, state: EngineState, slot):
    """Copy of one slot's recurrent state, penalty history, device drafts and (ngram) token history:
    swap-out's per-sequence part."""
    del params
    ssm = tuple((h[slot], c[slot]) for h, c in state.model.ssm)
    row = lambda pool: () if pool is None else pool[slot]
    return (ssm, state.penalties.in_prompt[slot], state.penalties.out_count[slot], row(state.last_drafts),
            row(state.history)), state


def restore_pages(params, state: EngineState, pages, saved):
    """Inverse of `save_pages` into (possibly other) pages; pages == num_pages are dropped (padding)."""
    del params
    kv = tuple((k.at[pages].set(ks, mode="drop"), v.at[pages].set(vs, mode="drop"))
               for (k, v), (ks, vs) in zip(state.model.kv + state.draft_kv, saved))
    n = len(state.model.kv)
    return None, dataclasses.replace(state, model=dataclasses.replace(state.model, kv=kv[:n]), draft_kv=kv[n:])


def restore_slot(params, state: EngineState, slot, saved):
    """Inverse of `save_slot` into (possibly another) slot."""
    del params
    ssm_s, in_prompt, out_count, drafts, history = saved
    ssm = tuple((h.at[slot].set(hs), c.at[slot].set(cs)) for (h, c), (hs, cs) in zip(state.model.ssm, ssm_s))
    pen = PenaltyState(state.penalties.in_prompt.at[slot].set(in_prompt),
                       state.penalties.out_count.at[slot].set(out_count))
    put = lambda pool, row: None if pool is None else pool.at[slot].set(row)
    return None, dataclasses.replace(state, model=dataclasses.replace(state.model, ssm=ssm), penalties=pen,
                                     last_drafts=put(state.last_drafts, drafts), history=put(state.history, history))


def take_snapshot(params, state: EngineState, slot, idx, snap):
    """Snapshot `snap` := the recurrent state at (slot, state position idx), every GDN layer."""
    del params
    snaps = tuple((sh.at[snap].set(h[slot, idx]), sc.at[snap].set(c[slot, idx]))
                  for (h, c), (sh, sc) in zip(state.model.ssm, state.snapshots))
    return None, dataclasses.replace(state, snapshots=snaps)


def load_prefix(params, state: EngineState, slot, snap, cow_src, cow_dst, tokens, prompt_len, n):
    """Start `slot` on a cached prefix of n tokens: its recurrent state (position 0) := snapshot `snap`
    (every GDN layer), page cow_dst := page cow_src in every KV pool incl. the MTP head's (cow_dst out
    of range: no copy), and its penalty history rebuilt from tokens[:n] (positions < prompt_len are
    prompt), as record_fed_tokens would have left it."""
    del params
    ssm = tuple((h.at[slot, 0].set(sh[snap]), c.at[slot, 0].set(sc[snap]))
                for (h, c), (sh, sc) in zip(state.model.ssm, state.snapshots))
    kv = tuple((k.at[cow_dst].set(k[cow_src], mode="drop"), v.at[cow_dst].set(v[cow_src], mode="drop"))
               for k, v in state.model.kv + state.draft_kv)
    pos = jnp.arange(tokens.shape[0])
    none = state.penalties.in_prompt.shape[0]
    in_prompt = state.penalties.in_prompt.at[slot].set(False)
    in_prompt = in_prompt.at[jnp.where((pos < n) & (pos < prompt_len), slot, none), tokens].set(True, mode="drop")
    out_count = state.penalties.out_count.at[slot].set(0)
    out_count = out_count.at[jnp.where((pos < n) & (pos >= prompt_len), slot, none), tokens].add(1, mode="drop")
    m = len(state.model.kv)
    history = state.history                  # (ngram on the device) the prefix's tokens; beyond n unread
    if history is not None:
        history = history.at[slot].set(tokens)
    return None, dataclasses.replace(state, model=ModelState(kv=kv[:m], ssm=ssm),
                                     penalties=PenaltyState(in_prompt, out_count), draft_kv=kv[m:], history=history)


def load_adapter(params, state: EngineState, slot, weights):
    """LoRA promotion: pool slot `slot` := weights {param key: (A [in, R], B [R, out])} (every pool key)."""
    del params
    lora = {key: (a.at[:, slot].set(weights[key][0].astype(a.dtype)), b.at[slot].set(weights[key][1].astype(b.dtype)))
            for key, (a, b) in state.lora.items()}
    return None, dataclasses.replace(state, lora=lora)
