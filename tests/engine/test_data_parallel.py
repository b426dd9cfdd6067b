"""Data-parallel attention on 4 virtual CPU devices (a child process: the device count is fixed when jax starts):
greedy and seeded tokens with dp 2 (+ expert parallel over both ranks) and dp 2 x tp 2 (experts over all four
devices) equal one device's on tiny Qwen3-Next, Nemotron-H and Qwen3-MoE (1 KV head: fewer than the devices);
the sequences spread over the ranks, each rank's pools really its own (the state split by "dp"), the experts
whole per device; the prefix cache hits on the rank that holds the prefix; preemption by recompute on a rank
whose pages run out; speculative decoding (host and device drafters) per rank; nothing compiles after warm-up."""
import pytest
from helpers import run_worker

SETUP = r"""
import json, os, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, os.environ["TESTS_DIR"])
from atlas_jax import LLM, SamplingParams
from atlas_jax.default_model import TINY_RANDOM_CONFIG, write_random_checkpoint
from atlas_jax.engine import dp_scheduler
from atlas_jax.param_tree import path_of
from atlas_jax.parallel.memory_plan import plan, state_bytes_per_device
from jax.sharding import AbstractMesh
import hf_models

placed = []                          # the rank every added sequence was placed on
_add = dp_scheduler.DataParallelScheduler.add
def recording(self, seq):
    _add(self, seq)
    placed.append(seq.dp_rank)
dp_scheduler.DataParallelScheduler.add = recording

root = sys.argv[1]
paths = {"qwen3_next": os.path.join(root, "qwen3_next"), "nemotron_h": os.path.join(root, "nemotron_h"),
         "qwen3_moe": os.path.join(root, "qwen3_moe")}
write_random_checkpoint(paths["qwen3_next"], {**TINY_RANDOM_CONFIG, "vocab_size": 512, "eos_token_id": 0,
                        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 16,
                        "linear_value_head_dim": 16})
hf_models.make_nemotron_h(paths["nemotron_h"], blocks="M*E-", heads=4, kv_heads=2, mamba_heads=8, groups=4)
hf_models.make_qwen3_moe(paths["qwen3_moe"], kv_heads=1)
kw = dict(kernels="xla", max_num_seqs=2, max_model_len=64, max_prefill_chunk=16, page_size=8, progress=False,
          compile_cache_dir="")
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [3] * 19 + [1], [7, 7, 1]]
layouts = {"1": {}, "dp2/ep": dict(data_parallel_size=2, enable_expert_parallel=True),
           "dp2xtp2/ep": dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)}
"""

WORKER = SETUP + r"""
out = {}
for name, path in paths.items():
    for layout, args in layouts.items():
        if name == "qwen3_moe" and layout == "dp2/ep":
            continue
        placed.clear()
        warm = name == "qwen3_next" and layout == "dp2xtp2/ep"
        llm = LLM(path, warmup=warm, **kw, **args)
        compiles = llm.num_compiles
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        tokens += [llm.generate([3, 1, 4, 1, 5, 9, 2, 6], seeded)[0].outputs[0].token_ids]
        dp = args.get("data_parallel_size", 1)
        r = llm.runner
        pools = [x.addressable_shards[0].data.shape[0] * dp == x.shape[0] for x in jax.tree.leaves(
            (r.state.model, r.state.penalties, r.state.snapshots, r.state.sampling, r.state.last_tokens))]
        flat = jax.tree_util.tree_flatten_with_path(r.params)[0]
        devices = dp * args.get("tensor_parallel_size", 1)
        experts = [x.addressable_shards[0].data.shape[0] * devices == x.shape[0] for keys, x in flat
                   if path_of(keys)[-2:-1] == ("experts",)]
        tp = args.get("tensor_parallel_size", 1)
        own = sum(x.addressable_shards[0].data.nbytes for _, x in flat)
        planned = plan(llm.cfg, llm.dtype, tp, bool(args.get("enable_expert_parallel")), llm.num_mtp_layers,
                       dp=dp).weights
        state = state_bytes_per_device(llm.cfg, r.num_pages, r.page_size, r.num_slots, llm.dtype,
                                       AbstractMesh((tp,), ("tp",)), r.state_positions, 0, r.num_snapshots)
        measured = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((r.state.model, r.state.snapshots)))
        out[f"{name}/{layout}"] = {"tokens": tokens, "placed": list(placed), "pools_split": pools,
                                   "experts_split": experts, "plan": [planned / own, state / measured],
                                   "compiles_after_warmup": llm.num_compiles - compiles if warm else None}
        del llm
# dp without expert parallel (the ranks never communicate); the prefix cache (a second turn hits, on the rank
# that holds the first); a pool of 9 pages per rank that 2 growing rows outgrow (preempted, recomputed)
path = paths["qwen3_next"]
prompt = [5, 17, 99, 3, 250, 12, 7, 64, 31, 8, 144, 2, 77, 301, 45, 9, 60, 21, 4, 88]
long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
for layout, args in (("1", {}), ("dp2", dict(data_parallel_size=2))):
    llm = LLM(path, warmup=False, enable_prefix_caching=True, **kw, **args)
    placed.clear()                   # a first turn on rank 1 (rank 0 busy); the next, alone, would go to rank 0
    runs = [llm.generate([[8, 8, 8, 8, 8, 8, 8, 8, 8, 1], prompt], greedy)[1].outputs[0].token_ids]
    runs.append(llm.generate(prompt + runs[0] + [1, 2, 3], greedy)[0].outputs[0].token_ids)
    hit, turns = llm.prefix_cache_stats()["hit_tokens"], list(placed)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    del llm
    llm = LLM(path, warmup=False, **{**kw, "num_pages": 9}, **args)
    grown = [o.outputs[0].token_ids for o in llm.generate([prompt[:8], prompt[8:16], prompt[4:12], prompt[:6]], long)]
    out[f"more/{layout}"] = {"turns": runs, "hit": hit, "placed": turns, "tokens": tokens, "grown": grown,
                             "preempted": llm.engine.stats()["num_preemptions"]["recompute"]}
    del llm
print("RESULT " + json.dumps(out))
"""

SPEC_WORKER = SETUP + r"""
path = paths["qwen3_next"]
out = {"qwen3_next/1": {"tokens": [o.outputs[0].token_ids for o in LLM(path, warmup=False, **kw).generate(prompts, greedy)]}}
# speculative decoding per rank: oracle drafts from the host (all accepted), self drafts on the device (verify
# steps overlapped, chase rows)
truth = {tuple(p): t for p, t in zip(prompts, out["qwen3_next/1"]["tokens"])}
oracle = lambda seq, k: truth[tuple(seq.prompt_ids)][len(seq.output_ids):len(seq.output_ids) + k]
for method in ("scripted", "self"):
    spec = {"method": method, "num_drafts": 2, **({"propose": oracle} if method == "scripted" else {})}
    llm = LLM(path, speculative=spec, warmup=False, **kw, **layouts["dp2/ep"])
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    stats = llm.spec_stats()
    out[f"spec/{method}"] = {"tokens": tokens, "drafted": stats["drafted"], "accepted": stats["accepted"],
                             "overlapped": llm.engine.num_overlapped}
    del llm
print("RESULT " + json.dumps(out))
"""

FAMILIES = ["qwen3_next", "nemotron_h", "qwen3_moe"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(WORKER, tmp_path_factory.mktemp("dp"))


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_one_device(results, family):
    """Greedy and seeded tokens of four prompts spread over two ranks equal one device's (a missing reduce of the
    experts' partial sums over the ranks, or a rank reading another's pages, changes them)."""
    one = results[f"{family}/1"]["tokens"]
    for layout in ("dp2/ep", "dp2xtp2/ep"):
        if f"{family}/{layout}" in results:
            assert results[f"{family}/{layout}"]["tokens"] == one, layout


@pytest.mark.parametrize("family", FAMILIES)
def test_ranks_hold_their_own_state(results, family):
    """The sequences go to both ranks (the less loaded one first); every pool (KV pages, recurrent slots,
    penalties, snapshots, sampling columns) is split by rank; the experts are whole per device, E / (dp x tp)."""
    for layout in ("dp2/ep", "dp2xtp2/ep"):
        r = results.get(f"{family}/{layout}")
        if r is None:
            continue
        assert sorted(r["placed"][:4]) == [0, 0, 1, 1], r["placed"]
        assert r["pools_split"] and all(r["pools_split"]), r["pools_split"]
        assert r["experts_split"] and all(r["experts_split"]), r["experts_split"]


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_plan_matches_measured_bytes(results, family):
    """scripts/plan_memory.py's numbers (--dp 2 [--tp 2] --ep): per-device weights and one rank's state within 10%
    of the engine's measured per-device bytes."""
    for layout in ("dp2/ep", "dp2xtp2/ep"):
        r = results.get(f"{family}/{layout}")
        if r is not None:
            assert all(0.9 < x < 1.1 for x in r["plan"]), (layout, r["plan"])


def test_no_compiles_after_warmup(results):
    assert results["qwen3_next/dp2xtp2/ep"]["compiles_after_warmup"] == 0


def test_data_parallel_without_expert_parallel(results):
    assert results["more/dp2"]["tokens"] == results["more/1"]["tokens"] == results["qwen3_next/1"]["tokens"][:4]


def test_prefix_cache_hits_on_the_rank_holding_the_prefix(results):
    """A second turn goes to the rank that cached the first (rank 1), where an idle engine would put a request
    without a hit on rank 0, and hits it; the tokens equal one device's."""
    one, dp = results["more/1"], results["more/dp2"]
    assert dp["turns"] == one["turns"]
    assert dp["hit"] == one["hit"] > 0
    assert dp["placed"] == [0, 1, 1], dp["placed"]


def test_preemption_on_a_rank(results):
    """Two rows on each rank outgrow its 9 pages: one is preempted (recompute) and the tokens stay exact."""
    one, dp = results["more/1"], results["more/dp2"]
    assert dp["grown"] == one["grown"]
    assert dp["preempted"] > 0


@pytest.fixture(scope="module")
def spec_results(tmp_path_factory):
    return run_worker(SPEC_WORKER, tmp_path_factory.mktemp("dp_spec"))


@pytest.mark.slow                    # speculative engines under dp compile for minutes on CPU
@pytest.mark.parametrize("method", ["scripted", "self"])
def test_speculative_decoding_per_rank(spec_results, method):
    """Verify steps over both ranks (rows, drafts and outputs mapped rank-major): greedy tokens equal one device's
    plain decoding. Oracle drafts from the host are all accepted; the self drafter's (on the device) overlap."""
    r = spec_results[f"spec/{method}"]
    assert r["tokens"] == spec_results["qwen3_next/1"]["tokens"]
    assert r["drafted"] > 0
    if method == "scripted":
        assert r["accepted"] == r["drafted"]
    else:
        assert r["overlapped"] > 0
