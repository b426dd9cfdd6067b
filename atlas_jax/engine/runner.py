"""ModelRunner: owns the params and the device state, and runs compiled steps.

Every step is a tuple of padded-dense segments (batch.py) compiled ahead of time
(`jit(...).lower(...).compile()`) per shape bucket and kept in `self.exes` (executables.py);
`num_compiles` counts every compilation, so a recompile in serving is visible. The buckets
(`step_shapes`; `warmup` compiles the largest first, buckets.py):
  decode:  one segment [Bd, 1], Bd a power of two <= bucket(max_num_seqs);
  mixed:   a decode segment [Bm, 1] (padding rows where fewer decode) + a prefill segment
           [Bp, Tp], Bp a power of two <= max_prefill_rows, Tp in prefill_token_buckets; Bm in
           mixed_decode_buckets (the decode buckets from max(16, Bd_max / 4) up; Bd_max alone up to 16);
  prefill: the prefill segment alone, when no row decodes (a first request's time to first token
           would otherwise carry Bd_max padding rows through every layer).
The block table always spans max_pages_per_seq pages (attention walks only the blocks the
longest row needs), so context length is not a bucket dimension. Padding rows and columns
are inert. Only sampled ids and, when a row asks, logprobs come back to the host.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..batch import StepBatch
from ..config import ModelConfig
from ..kernels import XLA, Kernels
from ..layers.linear import pack_linears
from ..layers.moe import pack_params
from ..models.decoder import lm_head_weight
from ..models.mtp import init_mtp_kv
from ..state.cache import init_snapshots, init_state
from . import steps
from .buckets import bucket, maximal, mixed_decode_buckets, powers_of_two, prefill_token_buckets  # noqa: F401
from .executables import Executables, MapBudgetError  # noqa: F401 (re-exported)
from .sampler import BIAS_COLUMNS, NO_BIAS, SamplingBatch, init_penalty_state
from .sampling_params import SamplingParams
from .scheduler import LoadPrefix, Snapshot, SwapIn, SwapOut
from .steps import EngineState

_GREEDY = SamplingParams(temperature=0.0)
SWAP_CHUNK_PAGES = 32        # swap moves a sequence's pages in calls of this many (one executable per direction)


@dataclasses.dataclass
class RowInput:
    """One sequence's share of a step (host side)."""
    tokens: list[int]          # new tokens, len >= 1
    start: int                 # tokens of this sequence already in the cache
    block_table: list[int]     # its pages, covering at least start + len(tokens) tokens
    slot: int                  # its recurrent-state / penalty-history slot
    params: SamplingParams = _GREEDY
    seed: int = 0
    step: int = 0              # tokens this request has sampled so far
    prompt_len: int = 0        # fed positions below this are prompt tokens (penalty history)
    state_idx: int = 0         # recurrent-state position to read (layers/gdn.py)
    next_token: int = -1       # MTP: the token after the last fed one when known (mid-prompt chunk), else -1
    draft_ok: bool = False     # MTP: the row may draft (its pages cover the draft positions)
    logit_adjust: tuple = ({}, False)   # Sequence.logit_adjustments(): ({token id: added logit}, only those)
    adapter: int = 0           # LoRA adapter slot (0 = the base model)


def draft_vocab(params, ids) -> dict:
    """The MTP head's draft vocabulary: its token ids [n] and the lm_head's columns for them [H, n]."""
    ids = jnp.asarray(ids, jnp.int32)
    return {"ids": ids, "lm_head": jnp.take(lm_head_weight(params), ids, axis=1)}


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int, num_slots: int,
                 max_pages_per_seq: int, dtype, max_num_seqs: int, max_prefill_chunk: int, max_prefill_rows: int,
                 kernels: Kernels = XLA, max_verify_tokens: int = 1, mtp_drafts: int = 0, mtp_layers: int = 0,
                 self_drafts: bool = False, num_snapshots: int = 0, lora_slots: int = 0, lora_rank: int = 0,
                 mtp_token_ids=None):
        """lora_slots > 0: a LoRA pool of lora_slots adapters (+ slot 0, the base model) of rank lora_rank
        on every adaptable projection, and an adapter column in every step. mtp_token_ids [n]: the MTP
        head drafts among these tokens only (params["mtp_vocab"], models/mtp.py)."""
        self.cfg = cfg
        if mtp_drafts and mtp_token_ids is not None:
            params = {**params, "mtp_vocab": draft_vocab(params, mtp_token_ids)}
        # Kernels.cpu: MoE experts and projections in the CPU custom calls' packed layouts
        self.params = pack_linears(pack_params(params)) if kernels.cpu else params
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots
        self.max_pages_per_seq = max_pages_per_seq
        self.decode_buckets = powers_of_two(max_num_seqs)
        self.prefill_row_buckets = powers_of_two(max_prefill_rows)
        self.prefill_token_buckets = prefill_token_buckets(max_prefill_chunk)
        self.mixed_decode_buckets = mixed_decode_buckets(self.decode_buckets)
        self.verify_sizes = list(range(2, max_verify_tokens + 1))    # K buckets: last token + K - 1 drafts
        self.state_positions = max(1, max_verify_tokens)             # recurrent-state positions per slot
        self.swap_chunk = min(SWAP_CHUNK_PAGES, bucket(max_pages_per_seq))   # pages per swap executable call
        self.mtp_drafts = mtp_drafts                                 # MTP drafts made by every step (0 = off)
        self.self_drafts = self_drafts                               # a compiled self-speculative draft step
        self.last_drafts = None                                      # [rows, mtp_drafts] from the last step
        self.state = EngineState(init_state(cfg, num_pages, page_size, num_slots, dtype, self.state_positions),
                                 init_penalty_state(num_slots, cfg.vocab_size),
                                 init_mtp_kv(cfg, mtp_layers, num_pages, page_size, dtype) if mtp_drafts else (),
                                 init_snapshots(cfg, num_snapshots, dtype),
                                 self._init_lora_pool(lora_slots, lora_rank, dtype))
        self.num_snapshots = num_snapshots
        self.dtype = dtype
        jitted = {
            "step": jax.jit(functools.partial(steps.step, cfg, kernels, mtp_drafts), donate_argnums=(1,)),
            "logits": jax.jit(functools.partial(steps.logits_step, cfg, kernels), donate_argnums=(1,)),
            "verify": jax.jit(functools.partial(steps.verify_step, cfg, kernels, mtp_drafts), donate_argnums=(1,)),
            "draft": jax.jit(functools.partial(steps.self_draft_step, cfg, kernels, max_verify_tokens - 1),
                             donate_argnums=(1,)),
            "save_pages": jax.jit(steps.save_pages, donate_argnums=(1,)),
            "save_slot": jax.jit(steps.save_slot, donate_argnums=(1,)),
            "restore_pages": jax.jit(steps.restore_pages, donate_argnums=(1,)),
            "restore_slot": jax.jit(steps.restore_slot, donate_argnums=(1,)),
            "snapshot": jax.jit(steps.take_snapshot, donate_argnums=(1,)),
            "prefix": jax.jit(steps.load_prefix, donate_argnums=(1,)),
            "adapter": jax.jit(steps.load_adapter, donate_argnums=(1,)),
        }
        self.exes = Executables(jitted, self.params, self.state)
        self.step_counts = {"decode": 0, "prefill": 0, "mixed": 0, "verify": 0, "verify_mixed": 0, "draft": 0}   # steps run

    def _init_lora_pool(self, slots: int, rank: int, dtype) -> dict:
        if not slots:
            return {}
        from .lora import pool_shapes
        return {key: (jnp.zeros((d_in, slots + 1, rank), dtype), jnp.zeros((slots + 1, rank, d_out), dtype))
                for key, (d_in, d_out) in pool_shapes(self.cfg, self.params).items()}

    @property
    def lora(self) -> bool:
        return bool(self.state.lora)

    # ---- buckets -----------------------------------------------------------------------------
    def step_shapes(self) -> list[tuple[tuple[int, int], ...]]:
        """Every segment-shape tuple `step` can run (what warmup compiles)."""
        shapes = [((b, 1),) for b in self.decode_buckets]
        prefill = [(bp, tp) for tp in self.prefill_token_buckets for bp in self.prefill_row_buckets]
        return shapes + [((bm, 1), p) for bm in self.mixed_decode_buckets for p in prefill] + [(p,) for p in prefill]

    def verify_shapes(self) -> list[tuple[tuple[int, int], ...]]:
        """Every segment-shape tuple `verify` can run: [B, K] alone, and [B_max, K_max] + each prefill shape."""
        if not self.verify_sizes:
            return []
        shapes = [((b, k),) for k in self.verify_sizes for b in self.decode_buckets]
        top = (self.decode_buckets[-1], self.verify_sizes[-1])
        return shapes + [(top, (bp, tp)) for tp in self.prefill_token_buckets for bp in self.prefill_row_buckets]

    def _prefill_shape(self, rows) -> tuple[int, int]:
        n = max(len(r.tokens) for r in rows)
        tp = next((t for t in self.prefill_token_buckets if t >= n), None)
        bp = next((b for b in self.prefill_row_buckets if b >= len(rows)), None)
        if tp is None or bp is None:
            raise ValueError(f"{len(rows)} prefill rows of up to {n} tokens exceed the compiled buckets "
                             f"(rows <= {self.prefill_row_buckets[-1]}, tokens <= {self.prefill_token_buckets[-1]})")
        return bp, tp

    # ---- host metadata: numpy arrays, transferred by the compiled executable's own call ----------------
    def _segment(self, rows: list[RowInput], b: int, t: int) -> StepBatch:
        p = self.max_pages_per_seq
        tokens = np.zeros((b, t), np.int32)
        q_len = np.zeros((b,), np.int32)
        start = np.zeros((b,), np.int32)
        table = np.zeros((b, p), np.int32)
        slot = np.full((b,), self.num_slots, np.int32)          # padding rows: out of range
        state_idx = np.zeros((b,), np.int32)
        adapter = np.zeros((b,), np.int32)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            if not 1 <= n <= t:
                raise ValueError(f"row {i} has {n} new tokens for a {t}-token bucket")
            if -(-(r.start + n) // self.page_size) > min(len(r.block_table), p):
                raise ValueError(f"row {i} needs pages for {r.start + n} tokens; it has {len(r.block_table)}")
            tokens[i, :n] = r.tokens
            q_len[i], start[i], slot[i], state_idx[i], adapter[i] = n, r.start, r.slot, r.state_idx, r.adapter
            table[i, :len(r.block_table)] = r.block_table
        return StepBatch(tokens=tokens, q_len=q_len, start=start, block_table=table, slot=slot, state_idx=state_idx,
                         adapter=adapter if self.lora else None)

    def _sampling(self, rows: list[RowInput | None], b: int) -> SamplingBatch:
        """Sampling columns for b rows: `rows` in order (None = a padding row), then padding rows
        (greedy, no penalties, no logprobs, the out-of-range slot)."""
        filler = RowInput(tokens=[0], start=0, block_table=[], slot=self.num_slots)
        rows = [r if r is not None else filler for r in rows] + [filler] * (b - len(rows))

        def col(get, dt):
            return np.array([get(r) for r in rows], dt)
        return SamplingBatch(
            temperature=col(lambda r: r.params.temperature, np.float32), top_k=col(lambda r: r.params.top_k, np.int32),
            top_p=col(lambda r: r.params.top_p, np.float32), min_p=col(lambda r: r.params.min_p, np.float32),
            repetition_penalty=col(lambda r: r.params.repetition_penalty, np.float32),
            presence_penalty=col(lambda r: r.params.presence_penalty, np.float32),
            frequency_penalty=col(lambda r: r.params.frequency_penalty, np.float32),
            num_logprobs=col(lambda r: -1 if r.params.logprobs is None else r.params.logprobs, np.int32),
            seed=col(lambda r: r.seed, np.uint32), step=col(lambda r: r.step, np.int32),
            slot=col(lambda r: r.slot, np.int32), **self._bias_columns(rows))

    @staticmethod
    def _bias_columns(rows) -> dict:
        ids = np.full((len(rows), BIAS_COLUMNS), NO_BIAS, np.int32)
        bias = np.zeros((len(rows), BIAS_COLUMNS), np.float32)
        only = np.zeros((len(rows),), bool)
        for i, r in enumerate(rows):
            adjust, only[i] = r.logit_adjust
            for j, (t, v) in enumerate(list(adjust.items())[:BIAS_COLUMNS]):
                ids[i, j], bias[i, j] = t, v
        return {"bias_ids": ids, "bias": bias, "bias_only": only}

    @property
    def num_compiles(self) -> int:
        return self.exes.num_compiles

    def _executable(self, kind: str, args):
        return self.exes.get(kind, args)

    def state_lost(self) -> bool:
        """True when a step consumed the donated state without returning a new one (it failed on the
        device): the engine cannot go on. False after a failure in host-side preparation."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.state))

    def _run(self, kind: str, *args):
        out, self.state = self._executable(kind, args)(self.params, self.state, *args)
        return out

    # ---- steps ------------------------------------------------------------------------------
    def step(self, decode: list[RowInput], prefill: list[RowInput] = ()) -> dict[str, np.ndarray]:
        """One forward over decode rows (1 token each) and prefill rows (a chunk each), sampling one
        token per row. Returns host arrays indexed like `decode + prefill`: tokens, and (when some row
        asked) logprob, top_ids, top_logprobs."""
        rows = list(decode) + list(prefill)
        if not rows:
            raise ValueError("a step needs at least one row")
        if len(decode) > self.decode_buckets[-1]:
            raise ValueError(f"{len(decode)} decode rows; the largest bucket is {self.decode_buckets[-1]}")
        if any(len(r.tokens) != 1 for r in decode):
            raise ValueError("decode rows carry exactly one token")
        if prefill and decode:
            want = ((next(b for b in self.mixed_decode_buckets if b >= len(decode)), 1), self._prefill_shape(prefill))
        else:
            want = (self._prefill_shape(prefill),) if prefill else ((bucket(len(decode)), 1),)
        shape = self.exes.choose("step", want)
        groups = tuple(g for g in (decode, prefill) if g)
        segments = tuple(self._segment(rows, *seg) for rows, seg in zip(groups, shape))
        pad = shape[0][0] - len(decode) if decode and prefill else 0     # a mixed step's padding decode rows
        sampling_rows = list(decode) + [None] * pad + list(prefill)
        b = sum(s.tokens.shape[0] for s in segments)
        live = [i for i, r in enumerate(sampling_rows) if r is not None]
        sampling = self._sampling(sampling_rows, b)
        out, drafts = self._run("step", segments, sampling, self._prompt_lens(segments, groups),
                                self._mtp_in(segments, groups, sampling_rows))
        self.step_counts["mixed" if prefill and decode else "prefill" if prefill else "decode"] += 1
        self.last_drafts = np.asarray(drafts)[live] if drafts is not None else None
        return self._outputs(out, live, rows)

    def verify(self, rows: list[RowInput], drafts: list[list[int]], prefill: list[RowInput] = ()):
        """One verify step: row i feeds its last token + drafts[i] (ragged, any row may have none),
        optionally beside prefill rows (a mixed step). Compiled per (batch bucket, K = 1 + the most
        drafts); a mixed step always uses the largest batch bucket and K. Returns (runs, out): runs[i]
        = the tokens decode row i emits (its accepted drafts, then the target's own token); out =
        `step`'s dict over the decode rows then the prefill rows (the plain sample: a decode row
        without drafts gets exactly what `step` would give it, penalties and logprobs included)."""
        if len(rows) > self.decode_buckets[-1]:
            raise ValueError(f"{len(rows)} verify rows; the largest bucket is {self.decode_buckets[-1]}")
        k = 1 + max(len(d) for d in drafts)
        if k not in self.verify_sizes:
            raise ValueError(f"{k - 1} drafts in a row; this engine verifies up to {len(self.verify_sizes)}")
        if prefill:
            want = ((self.decode_buckets[-1], self.verify_sizes[-1]), self._prefill_shape(prefill))
        else:
            want = ((bucket(len(rows)), k),)
        shape = self.exes.choose("verify", want)
        (b, k) = shape[0]
        rows = [dataclasses.replace(r, tokens=list(r.tokens) + list(d)) for r, d in zip(rows, drafts)]
        segments = tuple(self._segment(g, *seg) for g, seg in zip((rows, prefill), shape))
        draft_cols = np.full((b, k), -1, np.int32)
        for i, d in enumerate(drafts):
            draft_cols[i, :len(d)] = d
        sampling_rows = list(rows) + [None] * (b - len(rows)) + list(prefill)
        groups = (rows, prefill) if prefill else (rows,)
        first, target, accept, new_drafts = self._run(
            "verify", segments, self._sampling(sampling_rows, sum(s.tokens.shape[0] for s in segments)),
            self._prompt_lens(segments, groups),
            draft_cols, self._mtp_in(segments, groups, sampling_rows))
        self.step_counts["verify_mixed" if prefill else "verify"] += 1
        live = [i for i, r in enumerate(sampling_rows) if r is not None]
        self.last_drafts = np.asarray(new_drafts)[live] if new_drafts is not None else None
        out = self._outputs(first, live, list(rows) + list(prefill))
        target, accept = np.asarray(target), np.asarray(accept)
        runs = []
        for i, d in enumerate(drafts):
            n = 0
            while n < len(d) and accept[i, n]:
                n += 1
            runs.append([int(t) for t in d[:n]] + [int(target[i, n])] if d else [int(out["tokens"][i])])
        return runs, out

    def _outputs(self, sampled, live, rows) -> dict[str, np.ndarray]:
        """Host arrays of the live rows: tokens, and (when some row asked) logprob, top_ids, top_logprobs."""
        result = {"tokens": np.asarray(sampled.tokens)[live]}
        if any(r.params.logprobs is not None for r in rows):
            result.update(logprob=np.asarray(sampled.logprob)[live], top_ids=np.asarray(sampled.top_ids)[live],
                          top_logprobs=np.asarray(sampled.top_logprobs)[live])
        return result

    def self_draft(self, rows: list[RowInput], caps: list[int]) -> list[list[int]]:
        """Self-speculative drafts (steps.self_draft_step) for decode rows; up to caps[i] for row i."""
        ((b, _),) = self.exes.choose("draft", ((bucket(len(rows)), 1),))
        caps_col = np.zeros((b,), np.int32)
        caps_col[:len(caps)] = caps
        drafts = np.asarray(self._run("draft", self._segment(rows, b, 1), caps_col))
        self.step_counts["draft"] += 1
        return [[int(t) for t in drafts[i, :c]] for i, c in enumerate(caps)]

    @staticmethod
    def _prompt_lens(segments, groups):
        """Per segment [B] prompt lengths of its rows (0 for padding rows)."""
        return tuple(np.array([r.prompt_len for r in rows] + [0] * (s.tokens.shape[0] - len(rows)), np.int32)
                     for s, rows in zip(segments, groups))

    def _mtp_in(self, segments, groups, sampling_rows):
        """MTP inputs (steps.py): per segment the token after each fed position ([B, T], -1 where it is
        the token the step emits), and draft_ok per row. None without MTP."""
        if not self.mtp_drafts:
            return None
        next_tokens = []
        for seg, rows in zip(segments, groups):
            nt = np.zeros(seg.tokens.shape, np.int32)
            for i, r in enumerate(rows):
                nt[i, :len(r.tokens)] = list(r.tokens[1:]) + [r.next_token]
            next_tokens.append(nt)
        ok = np.zeros((sum(s.tokens.shape[0] for s in segments),), bool)
        ok[:len(sampling_rows)] = [r is not None and r.draft_ok for r in sampling_rows]
        return tuple(next_tokens), ok

    def chunked_logits(self, ids: list[int], pages: list[int], slot: int, chunk: int, warmed: bool = False):
        """fp32 logits [len(ids), V] of a prompt fed in chunks on `pages` / `slot` (the recurrent state
        carried between chunks). warmed: chunks padded to the prefill token buckets that warm-up compiles
        with score=True (serving); else to power-of-two buckets compiled on demand."""
        out, state_idx = [], 0
        for s in range(0, len(ids), chunk):
            row = RowInput(tokens=ids[s:s + chunk], start=s, block_table=pages, slot=slot, state_idx=state_idx)
            if warmed:
                ((_, t),) = self.exes.choose("logits", ((1, next(t for t in self.prefill_token_buckets
                                                                  if t >= len(row.tokens))),))
                (logits,) = self._run("logits", (self._segment([row], 1, t),))
                out.append(np.asarray(logits)[0, :len(row.tokens)])
            else:
                out += self.prompt_logits([row])
            state_idx = min(len(row.tokens), self.state_positions) - 1
        return np.concatenate(out, axis=0)

    def prompt_logits(self, rows: list[RowInput]) -> list[np.ndarray]:
        """fp32 logits of every new token: one [len(tokens), V] per row (compiled on demand)."""
        t = bucket(max(len(r.tokens) for r in rows))
        (logits,) = self._run("logits", (self._segment(rows, bucket(len(rows)), t),))
        logits = np.asarray(logits)
        return [logits[i, :len(r.tokens)] for i, r in enumerate(rows)]

    # ---- state operations (scheduler.py's plan ops, applied in order before a step) ----------
    def apply_ops(self, ops) -> None:
        for op in ops:
            if isinstance(op, SwapOut):
                op.seq.swapped_state = self.save_sequence_state(list(op.pages), op.slot)
            elif isinstance(op, SwapIn):
                self.restore_sequence_state(list(op.pages), op.slot, op.seq.swapped_state)
                op.seq.swapped_state = None
            elif isinstance(op, Snapshot):
                self.take_snapshot(op.slot, op.state_idx, op.snap)
            elif isinstance(op, LoadPrefix):
                self.load_prefix(op.slot, op.snap, op.cow, list(op.tokens), op.prompt_len)
            else:
                raise TypeError(f"unknown state operation {op!r}")

    def swap_bytes(self) -> tuple[int, int]:
        """(host bytes of one swapped-out page, of one swapped-out slot): the scheduler's swap-space accounting."""
        size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
        pages = jax.eval_shape(steps.save_pages, None, self.state, jax.ShapeDtypeStruct((1,), jnp.int32))
        return size(pages[0]), size(jax.eval_shape(steps.save_slot, None, self.state,
                                                   jax.ShapeDtypeStruct((), jnp.int32))[0])

    # ---- swap (preemption) ------------------------------------------------------------------
    def _swap_chunks(self, pages: list[int], pad: int) -> list[jax.Array]:
        """`pages` as [swap_chunk] id columns, the last padded with `pad` (at least one column)."""
        c = self.swap_chunk
        return [jnp.asarray(np.array(list(pages[i:i + c]) + [pad] * (c - len(pages[i:i + c])), np.int32))
                for i in range(0, max(len(pages), 1), c)]

    def save_sequence_state(self, pages: list[int], slot: int):
        """Host copy (numpy pytree) of a sequence's KV pages, recurrent slot and penalty history:
        (kv per pool (k [n, ...], v [n, ...]), ssm per layer, in_prompt, out_count)."""
        chunks = [self._run("save_pages", ids) for ids in self._swap_chunks(pages, 0)]
        chunks, slot_state = jax.device_get((chunks, self._run("save_slot", jnp.asarray(slot, jnp.int32))))
        kv = tuple(tuple(np.concatenate([ch[pool][j] for ch in chunks])[:len(pages)] for j in (0, 1))
                   for pool in range(len(chunks[0])))
        return (kv,) + tuple(slot_state)

    def restore_sequence_state(self, pages: list[int], slot: int, saved) -> None:
        """Write a `save_sequence_state` copy into `pages` (same count) and `slot`, bit-exactly."""
        kv_host = saved[0]
        if kv_host and len(kv_host[0][0]) != len(pages):
            raise ValueError(f"saved state has {len(kv_host[0][0])} pages; {len(pages)} given")
        c = self.swap_chunk
        for i, ids in enumerate(self._swap_chunks(pages, self.num_pages)):
            part = tuple(tuple(_pad_rows(x[i * c:(i + 1) * c], c) for x in kv) for kv in kv_host)
            self._run("restore_pages", ids, part)
        self._run("restore_slot", jnp.asarray(slot, jnp.int32), tuple(saved[1:]))

    # ---- prefix cache (state/prefix_cache.py) -------------------------------------------------
    def take_snapshot(self, slot: int, state_idx: int, snap: int) -> None:
        """Snapshot `snap` := the recurrent state of `slot` at position state_idx (device copy)."""
        i32 = lambda x: jnp.asarray(x, jnp.int32)
        self._run("snapshot", i32(slot), i32(state_idx), i32(snap))

    def load_prefix(self, slot: int, snap: int | None, cow: tuple[int, int] | None, tokens: list[int],
                    prompt_len: int) -> None:
        """Start `slot` on the cached prefix `tokens`: recurrent state from snapshot `snap`, page
        cow[1] := page cow[0] (copy-on-write), penalty history rebuilt (steps.load_prefix)."""
        i32 = lambda x: jnp.asarray(x, jnp.int32)
        col = np.zeros((self.max_pages_per_seq * self.page_size,), np.int32)
        col[:len(tokens)] = tokens
        src, dst = cow if cow is not None else (0, self.num_pages)
        self._run("prefix", i32(slot), i32(0 if snap is None else snap), i32(src), i32(dst), jnp.asarray(col),
                  i32(prompt_len), i32(len(tokens)))

    # ---- LoRA (engine/lora.py) ----------------------------------------------------------------
    def load_adapter(self, slot: int, weights: dict) -> None:
        """Pool slot `slot` := an adapter's weights {param key: (A [in, R], B [R, out])}; projections the
        adapter leaves alone get zeros. A data update of the donated state: nothing recompiles."""
        full = {}
        for key, (a, b) in self.state.lora.items():
            if key in weights:
                full[key] = tuple(jnp.asarray(w, jnp.float32) for w in weights[key])
            else:
                full[key] = (jnp.zeros((a.shape[0], a.shape[2]), jnp.float32), jnp.zeros(b.shape[1:], jnp.float32))
        unknown = set(weights) - set(full)
        if unknown:
            raise ValueError(f"adapter weights for {sorted(unknown)[:3]}, which this model's pool lacks")
        self._run("adapter", jnp.asarray(slot, jnp.int32), full)

    # ---- warm-up ----------------------------------------------------------------------------
    def warmup_jobs(self, swap: bool = False, score: bool = False, prefix: bool = False) -> list:
        """(kind, shape) of every executable serving can use."""
        jobs = [("step", s) for s in self.step_shapes()] + [("verify", s) for s in self.verify_shapes()]
        if self.self_drafts:
            jobs += [("draft", ((b, 1),)) for b in self.decode_buckets]
        if swap:
            jobs += [(kind, None) for kind in ("save_pages", "save_slot", "restore_pages", "restore_slot")]
        if score:
            jobs += [("logits", ((1, tp),)) for tp in self.prefill_token_buckets]
        if prefix:
            jobs += [("prefix", None)] + ([("snapshot", None)] if self.num_snapshots else [])
        if self.lora:
            jobs += [("adapter", None)]
        return jobs

    def warmup(self, swap: bool = False, progress: bool = True, score: bool = False, prefix: bool = False,
               background: bool = False) -> int:
        """Compile every serving shape now (lowered from abstract shapes, nothing runs), or (background)
        the maximal ones now and the rest in a thread (executables.py). Returns the compilations done."""
        return self.exes.warmup(self.warmup_jobs(swap, score, prefix), self.abstract_args, background=background,
                                progress=progress)

    def abstract_args(self, kind: str, shape) -> tuple:
        """ShapeDtypeStructs of a `kind` step's arguments after (params, state) for one bucket."""
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)

        def segment(b, t):
            return StepBatch(i32(b, t), i32(b), i32(b), i32(b, self.max_pages_per_seq), i32(b), i32(b),
                             i32(b) if self.lora else None)
        if kind == "draft":
            b = shape[0][0]
            args = (segment(b, 1), i32(b))
        elif kind == "logits":
            args = (tuple(segment(b, t) for b, t in shape),)
        elif kind in ("step", "verify"):
            segs = tuple(segment(b, t) for b, t in shape)
            b = sum(bb for bb, _ in shape)
            f32 = jax.ShapeDtypeStruct((b,), jnp.float32)
            sampling = SamplingBatch(f32, i32(b), f32, f32, f32, f32, f32, i32(b),
                                     jax.ShapeDtypeStruct((b,), jnp.uint32), i32(b), i32(b),
                                     i32(b, BIAS_COLUMNS), jax.ShapeDtypeStruct((b, BIAS_COLUMNS), jnp.float32),
                                     jax.ShapeDtypeStruct((b,), jnp.bool_))
            args = (segs, sampling, tuple(i32(bb) for bb, _ in shape))
            if kind == "verify":
                args += (i32(*shape[0]),)
            args += ((tuple(i32(*s) for s in shape), jax.ShapeDtypeStruct((b,), jnp.bool_)) if self.mtp_drafts
                     else None,)
        elif kind == "snapshot":
            args = (i32(), i32(), i32())
        elif kind == "prefix":
            args = (i32(), i32(), i32(), i32(), i32(self.max_pages_per_seq * self.page_size), i32(), i32())
        elif kind == "adapter":
            args = (i32(), {key: (jax.ShapeDtypeStruct((a.shape[0], a.shape[2]), jnp.float32),
                                  jax.ShapeDtypeStruct(b.shape[1:], jnp.float32))
                            for key, (a, b) in self.state.lora.items()})
        elif kind in ("save_pages", "restore_pages"):
            ids = i32(self.swap_chunk)
            args = (ids,) + ((jax.eval_shape(steps.save_pages, None, self.state, ids)[0],)
                             if kind == "restore_pages" else ())
        else:
            args = (i32(),) + ((jax.eval_shape(steps.save_slot, None, self.state, i32())[0],)
                               if kind == "restore_slot" else ())
        return args


def _pad_rows(x: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)]) if len(x) < n else x
