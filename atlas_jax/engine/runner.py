"""ModelRunner: owns the params and the device state, and runs compiled steps.

Every step is a tuple of padded-dense segments (batch.py) compiled ahead of time
(`jit(...).lower(...).compile()`) per shape bucket and kept in `self.exes` (executables.py);
`num_compiles` counts every compilation, so a recompile in serving is visible. The buckets
(buckets.Grid; `warmup` compiles the largest first, executables.py):
  decode:  one segment [Bd, 1], Bd a power of two <= bucket(max_num_seqs);
  mixed:   a decode segment [Bm, 1] (padding rows where fewer decode) + a prefill segment
           [Bp, Tp], Bp a power of two <= max_prefill_rows, Tp in prefill_token_buckets; Bm in
           mixed_decode_buckets (the decode buckets from max(16, Bd_max / 4) up; Bd_max alone up to 16);
  prefill: the prefill segment alone, when no row decodes (a first request's time to first token
           would otherwise carry Bd_max padding rows through every layer).
The block table always spans max_pages_per_seq pages (attention walks only the blocks the
longest row needs), so context length is not a bucket dimension. Padding rows and columns
are inert. Only sampled ids and, when a row asks, logprobs come back to the host. Host packing
of the rows is input_batch.py; the plan's state operations (swap, snapshot, prefix, adapter) are
state_ops.py, applied through `state_ops.apply(op)`.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..layers.linear import pack_linears
from ..layers.moe import pack_params
from ..models.decoder import lm_head_weight
from ..models.layout import abstract_params, check_params, paths_with
from ..models.mtp import init_mtp_kv
from ..parallel.multihost import STOP, CallChannel, host_args, to_host
from ..parallel.data_parallel import per_rank
from ..parallel.sharding import (abstract_sharded, conv_split, engine_mesh, model_rules, replicated, shard_params,
                                 state_shardings, tile_params)
from ..state.cache import init_snapshots, init_state
from . import steps
from .buckets import Grid, bucket
from .device_ngram import NgramSpec
from .executables import Executables
from .input_batch import InputBatch, RankedBatch
from .prompt_scoring import PromptScoring
from .row import RowInput
from .sampler import init_penalty_state, init_slot_sampling
from .sampling_params import BIAS_COLUMNS, MAX_LOGPROBS
from .state_ops import KINDS as STATE_OP_KINDS, RANK_OPS, SWAP_CHUNK_PAGES, StateOps
from .steps import EngineState


def draft_vocab(params, ids, cfg) -> dict:
    """The MTP head's draft vocabulary: its token ids [n] and the lm_head's columns for them [H, n]."""
    ids = jnp.asarray(ids, jnp.int32)
    return {"ids": ids, "lm_head": jnp.take(lm_head_weight(params, cfg), ids, axis=1)}


def prepared_params(params, specs, kernels):
    """The params as the steps use them: under Kernels.cpu the projections (roles proj / head, and the MTP draft
    vocabulary's lm_head) and every MoE layer's experts in the CPU kernels' packed layouts, chosen by the specs'
    roles (models/layout.py); unchanged otherwise. Sectioned params are tiled first where the table says
    (kernels.section_tiles, tensor parallel). Works on abstract params too (under jax.eval_shape)."""
    params = tile_params(params, specs, kernels.section_tiles)
    if not kernels.cpu:
        return params
    params = pack_params(params, sorted({s.path[:-1] for s in specs if s.role == "experts"}, key=str), kernels)
    heads = [("mtp_vocab", "lm_head")] if "mtp_vocab" in params else []
    return pack_linears(params, paths_with(specs, "proj", "head") + heads, kernels)


def served_params(config, params, mtp_token_ids=None, mesh=None):
    """(the params the steps use, their abstract form derived from the param specs alone). Both are checked:
    the loaded params against the specs, the prepared ones against the abstract form the executables are
    lowered from (ValueError naming the first leaf that differs). With a mesh: placed by the sharding rules."""
    specs = config.param_specs()
    check_params(params, abstract_params(specs, config.dtype))

    def prepare(p):
        if config.mtp_drafts and mtp_token_ids is not None:
            p = {**p, "mtp_vocab": draft_vocab(p, mtp_token_ids, config.model)}
        return prepared_params(p, specs, config.kernels)
    abstract = jax.eval_shape(prepare, abstract_params(specs, config.dtype))
    served = prepare(params)
    check_params(served, abstract)
    if mesh is not None:
        rules = model_rules(config.model, config.tensor_parallel_size, config.expert_parallel, config.data_parallel_size)
        return shard_params(served, specs, mesh, rules), abstract_sharded(abstract, specs, mesh, rules)
    return served, abstract


def _keeping_state(fn, sharding, out_sharding):
    """fn whose returned state is constrained to `sharding` (what the next step's executable is compiled for)
    and its outputs to `out_sharding` (replicated: any process reads them from its own devices)."""
    def run(params, state, *args):
        out, new = fn(params, state, *args)
        return jax.lax.with_sharding_constraint(out, out_sharding), jax.lax.with_sharding_constraint(new, sharding)
    return run


def host_outputs(sampled, live: list[int], logprobs: bool) -> dict[str, np.ndarray]:
    """Host arrays of the live rows: tokens, and (logprobs: some row asked) logprob, top_ids, top_logprobs."""
    result = {"tokens": to_host(sampled.tokens)[live]}
    if logprobs:
        result.update(logprob=to_host(sampled.logprob)[live], top_ids=to_host(sampled.top_ids)[live],
                      top_logprobs=to_host(sampled.top_logprobs)[live])
    return result


def initial_state(config, mtp_layers: int, ranks: int = 1) -> EngineState:
    """An empty engine's device state without the LoRA pool; `ranks` pools end to end in every leaf (data parallel)."""
    cfg, c, dtype, drafts = config.model, config.cache, config.dtype, config.device_drafts
    num_pages = c.num_pages + c.scratch_pages
    i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
    state = EngineState(
        init_state(cfg, num_pages, c.page_size, c.num_slots, dtype, config.max_verify_tokens),
        init_penalty_state(c.num_slots, cfg.vocab_size),
        init_mtp_kv(cfg, mtp_layers, num_pages, c.page_size, dtype) if config.mtp_drafts else (),
        init_snapshots(cfg, c.num_snapshots, dtype), {}, i32(c.num_slots),
        i32(c.num_slots, drafts) if drafts else None, i32(c.num_slots) if drafts else None,
        init_slot_sampling(c.num_slots, BIAS_COLUMNS),
        i32(c.num_slots, c.max_pages_per_seq * c.page_size) if config.ngram_on_device else None)
    return state if ranks == 1 else jax.tree.map(lambda x: jnp.concatenate([x] * ranks), state)


@dataclasses.dataclass
class Launched:
    """A dispatched step whose outputs are still on the device."""
    runner: "ModelRunner"
    sampled: object            # SampleOut (device): one plain sample per sampling row
    live: list[int]            # sampling rows that are real rows, in `decode + prefill` order
    logprobs: bool             # some row asked for logprobs
    runs: tuple = ()           # verify steps: (emitted [B, K], count [B], drafted [B]) on the device
    verify_live: list[int] = dataclasses.field(default_factory=list)   # verify steps: the real verify rows of `runs`

    def fetch(self) -> dict[str, np.ndarray]:
        """Wait for the step; its outputs as host arrays (ModelRunner.step; verify steps add emitted [rows, K],
        count [rows] and drafted [rows], the drafts fed, of the verify rows). The time blocked here adds to
        `runner.wait_seconds`."""
        self.runner.wait((self.sampled, self.runs))
        out = host_outputs(self.sampled, self.live, self.logprobs)
        for name, x in zip(("emitted", "count", "drafted"), self.runs):
            out[name] = to_host(x)[self.verify_live]
        return out


class ModelRunner:
    def __init__(self, config, params, mtp_token_ids=None):
        """config: EngineConfig. With LoRA, a pool of max_loras adapters (+ slot 0, the base model) of rank
        max_lora_rank on every adaptable projection, and an adapter column in every step. mtp_token_ids [n]:
        the MTP head drafts among these tokens only (params["mtp_vocab"], models/mtp.py)."""
        cfg, c, kernels, dtype = config.model, config.cache, config.kernels, config.dtype
        self.cfg, self.dtype, self.num_snapshots = cfg, dtype, c.num_snapshots
        mtp_drafts, verify_tokens, spec = config.mtp_drafts, config.max_verify_tokens, config.speculative
        ngram = NgramSpec(spec.ngram_min, spec.ngram_max, spec.num_drafts) if config.ngram_on_device else None
        self.dp = config.data_parallel_size          # > 1: the pools and batches below are per rank, D of each
        self.mesh = engine_mesh(config.tensor_parallel_size, self.dp)
        self.params, abstract = served_params(config, params, mtp_token_ids, self.mesh)
        self.num_pages, self.page_size = c.num_pages + c.scratch_pages, c.page_size
        self.num_slots, self.max_pages_per_seq = c.num_slots, c.max_pages_per_seq
        s = config.scheduler
        self.grid = Grid.create(s.max_num_seqs, s.max_prefill_rows, s.max_prefill_chunk, verify_tokens)
        self.state_positions = verify_tokens                         # recurrent-state positions per slot
        self.mtp_drafts = mtp_drafts                                 # MTP drafts made by every step (0 = off)
        self.self_drafts = spec is not None and spec.method == "self"
        self.state_sharding, self.state = self._placed_state(config, len(params.get("mtp", {}).get("layers", ())))
        batch = lambda: InputBatch(c.max_pages_per_seq, c.page_size, c.num_slots, lora=self.lora, mtp=bool(mtp_drafts))
        self.batch = batch() if self.dp == 1 else RankedBatch([batch() for _ in range(self.dp)])
        self.state_ops = StateOps(self, swap_chunk=min(SWAP_CHUNK_PAGES, bucket(c.max_pages_per_seq)))
        self.scoring = PromptScoring(self)
        self.section_tiles = kernels.section_tiles      # adapters' B of tiled projections are tiled alike
        self.tiled_sections = {".".join(map(str, s.path)): s.sections for s in config.param_specs()
                               if s.sections and s.role == "proj"} if kernels.section_tiles > 1 else {}
        self.exes = Executables(self._jitted(cfg, kernels, mtp_drafts, ngram, verify_tokens - 1, self.state_sharding,
                                             self.mesh, abstract if self.dp > 1 else None), abstract, self.state)
        dist = config.dist                           # rank 0 publishes every device call; the others follow it
        self.channel = CallChannel() if dist.multihost else None
        self.leader, self._following, self._diverged = dist.leader, False, False
        self.wait_seconds = 0.0                      # blocked on the device's step outputs (fetch, verify)
        self.step_counts = {"decode": 0, "prefill": 0, "mixed": 0, "verify": 0, "verify_mixed": 0, "draft": 0}   # steps run

    @staticmethod
    def _jitted(cfg, kernels, mtp_drafts: int, ngram, num_drafts: int, state_sharding=None, mesh=None,
                per_rank_params=None) -> dict:
        """kind -> jit(fn(params, state, *args)) with the state donated. per_rank_params (data parallel: the
        abstract params): the kinds a data-parallel engine serves, each run per dp rank."""
        part = functools.partial
        fns = {"step": part(steps.step, cfg, kernels, mtp_drafts, ngram),
               "logits": part(steps.logits_step, cfg, kernels),
               "score": part(steps.score_step, cfg, kernels, min(MAX_LOGPROBS, cfg.vocab_size)),
               "verify": part(steps.verify_step, cfg, kernels, mtp_drafts, ngram),
               "draft": part(steps.self_draft_step, cfg, kernels, num_drafts),
               "save_pages": steps.save_pages, "save_slot": steps.save_slot, "restore_pages": steps.restore_pages,
               "restore_slot": steps.restore_slot, "snapshot": steps.take_snapshot, "prefix": steps.load_prefix,
               "adapter": steps.load_adapter}
        if per_rank_params is not None:
            fns = {kind: per_rank(fns[kind], mesh, per_rank_params, state_sharding, batch=kind not in RANK_OPS)
                   for kind in ("step", "verify", "draft") + RANK_OPS}
        if state_sharding is not None:              # the state keeps its placement from step to step
            fns = {kind: _keeping_state(fn, state_sharding, replicated(mesh)) for kind, fn in fns.items()}
        return {kind: jax.jit(fn, donate_argnums=(1,)) for kind, fn in fns.items()}

    def _placed_state(self, config, mtp_layers: int):
        """(its sharding or None, the initial state): under data parallel made in place, split over the ranks
        (parallel/data_parallel.py); under tp split by heads where the rules say (parallel/sharding.py)."""
        split = conv_split(config.model, config.kernels.section_tiles)
        if self.dp > 1:
            ranked = functools.partial(initial_state, config, mtp_layers, self.dp)
            sharding = state_shardings(jax.eval_shape(ranked), self.mesh, split)
            return sharding, jax.jit(ranked, out_shardings=sharding)()
        state = dataclasses.replace(initial_state(config, mtp_layers), lora=self._init_lora_pool(config.lora, config.dtype))
        if self.mesh is None:
            return None, state
        sharding = state_shardings(state, self.mesh, split)
        return sharding, jax.device_put(state, sharding)

    def _init_lora_pool(self, lora, dtype) -> dict:
        if lora is None:
            return {}
        from .lora import pool_shapes
        slots, rank = lora.max_loras, lora.max_lora_rank
        return {key: (jnp.zeros((d_in, slots + 1, rank), dtype), jnp.zeros((slots + 1, rank, d_out), dtype))
                for key, (d_in, d_out) in pool_shapes(self.cfg, self.params).items()}

    @property
    def lora(self) -> bool:
        return bool(self.state.lora)

    @property
    def num_compiles(self) -> int:
        return self.exes.num_compiles

    def state_lost(self) -> bool:
        """True when a step consumed the donated state without returning a new one (it failed on the
        device, or returned it in error): the engine cannot go on. False after a failure in host-side
        preparation (called on failure paths only: it waits for the state)."""
        if self._diverged or any(x.is_deleted() for x in jax.tree.leaves(self.state)):
            return True
        try:                          # a step that failed on the device (e.g. a lost peer) left its outputs in error
            jax.block_until_ready(self.state)
        except Exception:             # noqa: BLE001
            return True
        return False

    def _run(self, kind: str, *args):
        if self.channel is not None:                 # every rank runs the same call on the same host arguments
            if not (self.leader or self._following):
                raise RuntimeError("a rank other than 0 runs only rank 0's device calls (follow())")
            args = host_args(args)
        exe = self.exes.get(kind, args)              # compiled before it is published: a failed compile is contained
        if self.channel is not None and self.leader:
            self.channel.send(kind, args)
        try:
            out, self.state = exe(self.params, self.state, *args)
        except BaseException:
            self._diverged = self.channel is not None    # the followers ran it: nothing after this is contained
            raise
        return out

    # ---- multi-host (parallel/multihost.py) ---------------------------------------------------
    def follow(self) -> int:
        """A rank other than 0: run rank 0's device calls, in its order, until it stops (`close`); returns
        the calls run. Raises when rank 0 is gone."""
        if self.channel is None or self.leader:
            raise RuntimeError("follow() is for the ranks other than 0 of a multi-host engine")
        calls, self._following = 0, True
        try:
            while True:
                kind, args = self.channel.receive()
                if kind == STOP:
                    jax.block_until_ready(self.state)
                    return calls
                self._run(kind, *args)
                calls += 1
        finally:
            self._following = False

    def close(self) -> None:
        """Rank 0 of a multi-host engine: tell the followers to stop (they return from `follow`)."""
        if self.channel is not None and self.leader and not self.channel.closed:
            self.channel.send(STOP)                  # later sends raise (CallChannel.closed)

    # ---- steps ------------------------------------------------------------------------------
    def step(self, decode: list[RowInput], prefill: list[RowInput] = ()) -> dict[str, np.ndarray]:
        """One forward over decode rows (1 token each) and prefill rows (a chunk each), sampling one
        token per row. Returns host arrays indexed like `decode + prefill`: tokens, and (when some row
        asked) logprob, top_ids, top_logprobs."""
        return self.launch(decode, prefill).fetch()

    def launch(self, decode: list[RowInput], prefill: list[RowInput] = ()) -> "Launched":
        """`step` without waiting: the step is dispatched (the device runs it after what is queued) and
        its outputs stay on the device until `Launched.fetch()`. Under data parallel each rank's rows
        (RowInput.rank) are padded to one shape bucket, the ranks' batches end to end (parallel/data_parallel.py)."""
        g, rows = self.grid, list(decode) + list(prefill)
        if not rows:
            raise ValueError("a step needs at least one row")
        if any(len(r.tokens) != 1 for r in decode):
            raise ValueError("decode rows carry exactly one token")
        nd = self._most_per_rank(decode)
        if nd > g.decode_buckets[-1]:
            raise ValueError(f"{nd} decode rows{' on one rank' if self.dp > 1 else ''}; the largest bucket is "
                             f"{g.decode_buckets[-1]}")
        if prefill:
            prefill_shape = g.prefill_shape(self._most_per_rank(prefill), max(len(r.tokens) for r in prefill))
        if prefill and decode:
            want = ((next(b for b in g.mixed_decode_buckets if b >= nd), 1), prefill_shape)
        else:
            want = (prefill_shape,) if prefill else ((bucket(nd), 1),)
        shape = self.exes.choose("step", want)
        groups, sampling_rows, index = self._by_rank(shape, decode, prefill, pad_first=bool(decode and prefill))
        out, _ = self._run("step", *self.batch.pack(groups, shape, sampling_rows))
        self.batch.commit()
        self.step_counts["mixed" if prefill and decode else "prefill" if prefill else "decode"] += 1
        return Launched(self, out, [index[id(r)] for r in rows], any(r.params.logprobs is not None for r in rows))

    def _most_per_rank(self, rows) -> int:
        return max(sum(r.rank == k for r in rows) for k in range(self.dp))

    def _by_rank(self, shape, first, second, pad_first: bool):
        """A step's rows grouped by data-parallel rank (RowInput.rank), each rank's block padded to `shape`:
        (groups, sampling_rows, index): per rank its segments' row lists (`first`, then `second` if any) and
        sampling rows (None: padding; the first segment padded to its bucket when pad_first), and id(row) ->
        its sampling row over the ranks' blocks end to end. One rank's groups and rows (not lists) when dp == 1
        (InputBatch keeps device-resident columns of its own)."""
        width = sum(b for b, _ in shape)              # one rank's sampling rows
        groups, sampling_rows, index = [], [], {}
        for k in range(self.dp):
            a, p = [r for r in first if r.rank == k], [r for r in second if r.rank == k]
            rows_k = a + [None] * (shape[0][0] - len(a) if pad_first else 0) + p
            index.update((id(r), k * width + i) for i, r in enumerate(rows_k) if r is not None)
            groups.append(tuple(x for x, on in ((a, first), (p, second)) if on))
            sampling_rows.append(rows_k)
        return (groups[0], sampling_rows[0], index) if self.dp == 1 else (groups, sampling_rows, index)

    def wait(self, outputs):
        """Block until a step's device outputs are ready; the time blocked adds to `wait_seconds`."""
        t0 = time.perf_counter()
        jax.block_until_ready(outputs)
        self.wait_seconds += time.perf_counter() - t0
        return outputs

    def verify(self, rows: list[RowInput], drafts: list[list[int]], prefill: list[RowInput] = (),
               room: list[int] | None = None):
        """`launch_verify`, waited for: (runs, out), runs[i] = the tokens decode row i emits (its accepted
        drafts, then the target's own token), out = its fetched outputs."""
        out = self.launch_verify(rows, drafts, prefill, room).fetch()
        return [[int(t) for t in out["emitted"][i, :out["count"][i]]] for i in range(len(rows))], out

    def launch_verify(self, rows: list[RowInput], drafts: list[list[int]], prefill: list[RowInput] = (),
                      room: list[int] | None = None) -> Launched:
        """One verify step, dispatched: row i feeds its last token + drafts[i] (ragged, any row may have
        none; steps.DRAFT: the slot's MTP draft on the device), optionally beside prefill rows (a mixed
        step); room[i] caps a chase row's drafts (steps.chase; default: its drafts). Compiled per (batch
        bucket, K = 1 + the most drafts); a mixed step uses the largest batch bucket and K. Its outputs
        are `step`'s over the decode rows then the prefill rows (the plain sample: a decode row without
        drafts gets exactly what `step` would give it, penalties and logprobs included), plus emitted
        [rows, K] and count [rows] per decode row."""
        g, nv = self.grid, self._most_per_rank(rows)
        if nv > g.decode_buckets[-1]:
            raise ValueError(f"{nv} verify rows{' on one rank' if self.dp > 1 else ''}; the largest bucket is "
                             f"{g.decode_buckets[-1]}")
        k = max(2, 1 + max(len(d) for d in drafts))
        if k not in g.verify_sizes:
            raise ValueError(f"{k - 1} drafts in a row; this engine verifies up to {len(g.verify_sizes)}")
        if prefill:
            want = ((g.decode_buckets[-1], g.verify_sizes[-1]),
                    g.prefill_shape(self._most_per_rank(prefill), max(len(r.tokens) for r in prefill)))
        else:
            want = ((bucket(nv), k),)
        shape = self.exes.choose("verify", want)
        (b, k), width = shape[0], sum(bb for bb, _ in shape)
        rows = [dataclasses.replace(r, tokens=list(r.tokens) + list(d)) for r, d in zip(rows, drafts)]
        groups, sampling_rows, index = self._by_rank(shape, rows, prefill, pad_first=True)
        verify_live = [index[id(r)] // width * b + index[id(r)] % width for r in rows]   # rows of [D * b, K]
        draft_cols = np.full((self.dp * b, k), -1, np.int32)
        room_col = np.zeros((self.dp * b,), np.int32)
        for i, d in zip(verify_live, drafts):
            draft_cols[i, :len(d)] = d
        room_col[verify_live] = [len(d) for d in drafts] if room is None else room
        segments, sampling, prompt_lens, mtp_in = self.batch.pack(groups, shape, sampling_rows, verify=True)
        first, emitted, count, drafted, _ = self._run("verify", segments, sampling, prompt_lens, draft_cols, room_col,
                                                      mtp_in)
        self.batch.commit()
        self.step_counts["verify_mixed" if prefill else "verify"] += 1
        live = [index[id(r)] for r in rows + list(prefill)]
        return Launched(self, first, live, any(r.params.logprobs is not None for r in list(rows) + list(prefill)),
                        (emitted, count, drafted), verify_live)

    def device_drafts(self, slot: int) -> np.ndarray:
        """MTP / device ngram: the drafts slot's last step made, waiting on the device for its next verify row."""
        return to_host(self.state.last_drafts)[slot]

    def self_draft(self, rows: list[RowInput], caps: list[int], room: list[int]) -> None:
        """Dispatch self-speculative drafts (steps.self_draft_step) for decode rows, up to caps[i] for row i
        (room[i]: a chase row's cap before its previous acceptance, steps.chase); they stay on the device."""
        ((b, _),) = shape = self.exes.choose("draft", ((bucket(self._most_per_rank(rows)), 1),))
        groups, _, index = self._by_rank(shape, rows, (), pad_first=False)
        caps_col, room_col = np.zeros((self.dp * b,), np.int32), np.zeros((self.dp * b,), np.int32)
        at = [index[id(r)] for r in rows]
        caps_col[at], room_col[at] = caps, room
        segment = self.batch.segment(groups[0], b, 1) if self.dp == 1 else self.batch.segments(groups, b, 1)
        self._run("draft", segment, caps_col, room_col)
        self.step_counts["draft"] += 1

    # ---- warm-up ----------------------------------------------------------------------------
    def warmup_jobs(self, swap: bool = False, score: bool = False, prefix: bool = False) -> list:
        """(kind, shape) of every executable serving can use."""
        jobs = [("step", s) for s in self.grid.step_shapes()] + [("verify", s) for s in self.grid.verify_shapes()]
        if self.self_drafts:
            jobs += [("draft", ((b, 1),)) for b in self.grid.decode_buckets]
        if swap:
            jobs += [(kind, None) for kind in ("save_pages", "save_slot", "restore_pages", "restore_slot")]
        if score:
            jobs += [("score", ((1, tp),)) for tp in self.grid.prefill_token_buckets]
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
        """ShapeDtypeStructs of a `kind` executable's arguments after (params, state) for one bucket."""
        return self.state_ops.abstract(kind) if kind in STATE_OP_KINDS else self.batch.abstract(kind, shape)
