"""On-device sampling: penalties, greedy, temperature, top-k, top-p, min-p, logprobs; one RNG
stream per request.

A row's random key is fold_in(PRNGKey(seed), step), where step counts the tokens that
request has sampled so far, and the draw is always taken over the row's logits in vocabulary
order: a request's output never depends on what else shares the batch, nor on which of the
paths below the batch took.

Penalties (vLLM semantics) read a per-slot token history kept on device (`PenaltyState`):
which ids occur in the prompt, and how often each id occurs in the output. It is updated from
the tokens a step *feeds* (positions < prompt_len are prompt, the rest output), so it always
describes exactly the tokens in the cache: a re-prefill after preemption rebuilds it, and a
row whose first chunk starts at 0 clears its slot's history first.

Cost: an all-greedy batch without penalties computes only argmax; the penalty gather, the
top-k/top-p sort (slow on CPU) and the top-n logprobs run only when some row asks for them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..models.decoder import argmax

from .sampling_params import MAX_LOGPROBS, NO_BIAS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    temperature: jax.Array         # [B] f32; 0 = greedy
    top_k: jax.Array               # [B] i32; 0 = off
    top_p: jax.Array               # [B] f32 in (0, 1]; 1 = off
    min_p: jax.Array               # [B] f32 in [0, 1]; 0 = off
    repetition_penalty: jax.Array  # [B] f32 > 0; 1 = off
    presence_penalty: jax.Array    # [B] f32; 0 = off
    frequency_penalty: jax.Array   # [B] f32; 0 = off
    num_logprobs: jax.Array        # [B] i32; -1 = none, n >= 0: sampled token + top n
    seed: jax.Array                # [B] u32
    step: jax.Array                # [B] i32 tokens sampled so far by the row's request
    slot: jax.Array                # [B] i32 the row's penalty-history slot (num_slots for padding)
    bias_ids: jax.Array            # [B, BIAS_COLUMNS] i32 adjusted token ids (NO_BIAS = none)
    bias: jax.Array                # [B, BIAS_COLUMNS] f32 added to those tokens' logits (-inf bans)
    bias_only: jax.Array           # [B] bool: every token not in bias_ids is banned (allowed_token_ids)


FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
INT_COLUMNS = ("top_k", "num_logprobs", "seed", "bias_only")   # seed: its uint32 bits; bias_only: 0 / 1
INERT = dict(temperature=0.0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0, top_k=0, num_logprobs=-1, seed=0, bias_only=0)   # bias_ids: NO_BIAS, bias: 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Sampling parameters per slot: the persistent batch's columns (EngineState.sampling, [S + 1]; row S holds
    the padding rows' inert defaults) or the slots a step rewrites ([U] beside their slot ids). A row's
    SamplingBatch is gathered from its slot's row; the host sends a slot's parameters only when the
    sequence holding it (or its logit adjustments) changed (input_batch.py). Four arrays, so a step adds
    four scatters and four gathers."""
    floats: jax.Array          # [N, len(FLOAT_COLUMNS)] f32
    ints: jax.Array            # [N, len(INT_COLUMNS)] i32
    bias_ids: jax.Array        # [N, BIAS_COLUMNS] i32
    bias: jax.Array            # [N, BIAS_COLUMNS] f32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInput:
    """A step's sampling argument: per row its slot and RNG step, and the slot columns to rewrite first."""
    slot: jax.Array            # [B] i32 (num_slots for padding rows: the inert row)
    step: jax.Array            # [B] i32 tokens sampled so far by the row's request
    update_slot: jax.Array     # [U] i32 slots whose columns `update` replaces (num_slots + 1: none)
    update: SlotSampling       # [U]

    def resolve(self, columns: SlotSampling) -> tuple[SlotSampling, SamplingBatch]:
        """(the columns after this step's updates, the rows' SamplingBatch gathered from them)."""
        write = lambda cols, slot, upd: jax.tree.map(lambda c, u: c.at[slot].set(u, mode="drop"), cols, upd)
        n = columns.floats.shape[0]
        columns = jax.lax.cond(jnp.any(self.update_slot < n), write, lambda c, s, u: c, columns, self.update_slot,
                               self.update)
        idx = jnp.minimum(self.slot, n - 1)
        floats, ints = columns.floats[idx], columns.ints[idx]
        rows = {name: floats[:, i] for i, name in enumerate(FLOAT_COLUMNS)}
        rows.update({name: ints[:, i] for i, name in enumerate(INT_COLUMNS)})
        rows["seed"] = jax.lax.bitcast_convert_type(rows["seed"], jnp.uint32)
        rows["bias_only"] = rows["bias_only"] != 0
        return columns, SamplingBatch(**rows, bias_ids=columns.bias_ids[idx], bias=columns.bias[idx], step=self.step,
                                      slot=self.slot)


def init_slot_sampling(num_slots: int, bias_columns: int) -> SlotSampling:
    """Every slot (and the padding row num_slots) at the inert defaults: greedy, no filters, no logprobs."""
    n = num_slots + 1
    return SlotSampling(jnp.tile(jnp.array([INERT[c] for c in FLOAT_COLUMNS], jnp.float32), (n, 1)),
                        jnp.tile(jnp.array([INERT[c] for c in INT_COLUMNS], jnp.int32), (n, 1)),
                        jnp.full((n, bias_columns), NO_BIAS, jnp.int32), jnp.zeros((n, bias_columns), jnp.float32))


def slot_sampling_bytes(bias_columns: int) -> int:
    """Device bytes of one slot's row of the persistent batch's columns."""
    one = jax.eval_shape(lambda: init_slot_sampling(0, bias_columns))
    return sum(x.dtype.itemsize * (x.size // x.shape[0]) for x in jax.tree.leaves(one))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyState:
    in_prompt: jax.Array    # [S, V] bool
    out_count: jax.Array    # [S, V] i32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOut:
    tokens: jax.Array       # [B] i32
    logprob: jax.Array      # [B] f32 log-softmax of the raw logits at the sampled token
    top_ids: jax.Array      # [B, MAX_LOGPROBS] i32 (zeros unless some row asked)
    top_logprobs: jax.Array  # [B, MAX_LOGPROBS] f32


def init_penalty_state(num_slots: int, vocab: int) -> PenaltyState:
    return PenaltyState(jnp.zeros((num_slots, vocab), bool), jnp.zeros((num_slots, vocab), jnp.int32))


def record_fed_tokens(ps: PenaltyState, segments, prompt_lens) -> PenaltyState:
    """Add the tokens each segment feeds to its rows' histories (see module doc)."""
    in_prompt, out_count = ps.in_prompt, ps.out_count
    none = in_prompt.shape[0]
    for seg, plen in zip(segments, prompt_lens):
        fresh_slot = jnp.where(seg.start == 0, seg.slot, none)
        in_prompt = in_prompt.at[fresh_slot].set(False, mode="drop")
        out_count = out_count.at[fresh_slot].set(0, mode="drop")
        slot = jnp.broadcast_to(seg.slot[:, None], seg.tokens.shape)
        is_prompt = seg.positions < plen[:, None]
        in_prompt = in_prompt.at[jnp.where(seg.valid & is_prompt, slot, none), seg.tokens].set(True, mode="drop")
        out_count = out_count.at[jnp.where(seg.valid & ~is_prompt, slot, none), seg.tokens].add(1, mode="drop")
    return PenaltyState(in_prompt, out_count)


def _apply_penalties(logits, s: SamplingBatch, ps: PenaltyState):
    in_prompt = jnp.take(ps.in_prompt, s.slot, axis=0, mode="fill", fill_value=False)
    count = jnp.take(ps.out_count, s.slot, axis=0, mode="fill", fill_value=0)
    seen = in_prompt | (count > 0)
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - s.frequency_penalty[:, None] * count
            - s.presence_penalty[:, None] * (count > 0).astype(jnp.float32))


def _apply_bias(logits, s: SamplingBatch):
    rows = jnp.arange(logits.shape[0])[:, None]
    listed = jnp.zeros(logits.shape, bool).at[rows, s.bias_ids].set(True, mode="drop")
    logits = jnp.where(s.bias_only[:, None] & ~listed, -jnp.inf, logits)
    return logits.at[rows, s.bias_ids].add(s.bias, mode="drop")


def _top_k_top_p_mask(scaled, top_k, top_p):
    """scaled [V] -> the same logits with tokens outside top-k / the top-p nucleus at -inf."""
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(scaled.shape[-1])
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    keep = keep & ((jnp.cumsum(probs) - probs < top_p) | (rank == 0))
    keep_vocab = jnp.zeros_like(keep).at[order].set(keep)
    return jnp.where(keep_vocab, scaled, -jnp.inf)


def _processed(logits, s: SamplingBatch):
    """The logits a row samples from: temperature-scaled, tokens outside top-k / top-p / min-p at -inf."""
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    filtered = jnp.any((s.temperature > 0) & ((s.top_k > 0) | (s.top_p < 1.0)))
    scaled = jax.lax.cond(filtered, jax.vmap(_top_k_top_p_mask), lambda x, k, p: x, scaled, s.top_k, s.top_p)
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = probs >= s.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(keep, scaled, -jnp.inf)


def _keys(s: SamplingBatch):
    return jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.PRNGKey(seed), step))(s.seed, s.step)


def _draw(logits, s: SamplingBatch):
    return jax.vmap(jax.random.categorical)(_keys(s), _processed(logits, s)).astype(jnp.int32)


def _logprobs(logits, tokens, s: SamplingBatch):
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0]
    k = min(MAX_LOGPROBS, logits.shape[-1])
    top_lp, top_ids = jax.lax.top_k(lp, k)
    pad = MAX_LOGPROBS - k
    return chosen, jnp.pad(top_ids, ((0, 0), (0, pad))).astype(jnp.int32), jnp.pad(top_lp, ((0, 0), (0, pad)))


def sample(logits, s: SamplingBatch, ps: PenaltyState | None = None) -> SampleOut:
    """logits [B, V] fp32 (raw model output) -> SampleOut: penalties, then logit_bias, then the
    token. Logprobs are of the raw logits."""
    raw = logits
    if ps is not None:
        penalised = jnp.any((s.repetition_penalty != 1.0) | (s.presence_penalty != 0.0) | (s.frequency_penalty != 0.0))
        logits = jax.lax.cond(penalised, _apply_penalties, lambda l, s, ps: l, logits, s, ps)
    biased = jnp.any(s.bias_ids != NO_BIAS)
    logits = jax.lax.cond(biased, _apply_bias, lambda l, s: l, logits, s)
    greedy = argmax(logits)
    drawn = jax.lax.cond(jnp.any(s.temperature > 0), _draw, lambda l, s: greedy, logits, s)
    tokens = jnp.where(s.temperature > 0, drawn, greedy)
    b = logits.shape[0]
    empty = (jnp.zeros((b,), jnp.float32), jnp.zeros((b, MAX_LOGPROBS), jnp.int32),
             jnp.zeros((b, MAX_LOGPROBS), jnp.float32))
    lp = jax.lax.cond(jnp.any(s.num_logprobs >= 0), _logprobs, lambda *_: empty, raw, tokens, s)
    return SampleOut(tokens, *lp)


def _verify_sampled(logits, drafts, s: SamplingBatch, greedy):
    """Speculative sampling with deterministic drafts (the draft distribution q is one-hot), coupled
    to plain sampling: each position draws the token plain decoding would draw there (same key:
    seed and step, same filters), and the draft is accepted iff it equals that token. So accepting
    d has probability p(d) and a rejection yields a token distributed as p without d — exact
    rejection sampling — and a seeded request's output does not depend on which drafts were made."""
    token = jnp.where(s.temperature > 0, _draw(logits, s), greedy)
    return token, (drafts >= 0) & (drafts == token)


def verify(logits, drafts, s: SamplingBatch):
    """Acceptance of drafted tokens. logits [B, K, V]: the target's logits after each fed token
    (position t follows the row's t-th fed token); drafts [B, K]: the draft the row fed at position
    t + 1 (-1 where none). s: the rows' sampling columns, step = tokens the row's request produced
    before this step; position t uses step + t, so the RNG stream follows accepted tokens only.
    Returns (target [B, K] i32, accept [B, K] bool): the host emits drafts while accepted and, at
    the first rejection (or after the last draft), target at that position. Greedy rows: target =
    argmax, accept = (draft == argmax). Penalties and logit_bias are not applied (rows with them or
    with logprobs are given no drafts; their one token comes from `sample`)."""
    b, k, v = logits.shape
    flat = logits.reshape(b * k, v)
    rep = jax.tree.map(lambda x: jnp.repeat(x, k, axis=0), s)
    rep = dataclasses.replace(rep, step=rep.step + jnp.tile(jnp.arange(k, dtype=jnp.int32), b))
    greedy = argmax(flat)
    d = drafts.reshape(-1)
    target, accept = jax.lax.cond(jnp.any(s.temperature > 0), _verify_sampled,
                                  lambda l, d, s, g: (g, d == g), flat, d, rep, greedy)
    return target.reshape(b, k), accept.reshape(b, k)
