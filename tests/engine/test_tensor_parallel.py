"""Tensor parallel on 4 virtual CPU devices (a child process: the device count is fixed when jax starts):
greedy and seeded tokens with tp 2 / 4 equal one device's on tiny Qwen3-Next, Nemotron-H and Qwen3.5-MoE, the params and
state really split by the sharding rules (each split leaf's shard holds 1 / tp of it), no compile after warm-up."""
import pytest
from helpers import run_worker

WORKER = r"""
import json, os, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, os.environ["TESTS_DIR"])
import numpy as np
from atlas_jax import LLM, SamplingParams
from atlas_jax.default_model import TINY_RANDOM_CONFIG, write_random_checkpoint
from atlas_jax.param_tree import path_of
from atlas_jax.parallel.sharding import partition
from atlas_jax.parallel.memory_plan import plan, state_bytes_per_device
from jax.sharding import AbstractMesh


from atlas_jax.weights import loader
regions = []                         # (param path, region size / param size) of every shard the loader read
_read_shard = loader.read_shard
def recording(spec, index, get):
    region = _read_shard(spec, index, get)
    regions.append((spec.path, region.size / np.prod(spec.shape)))
    return region
loader.read_shard = recording


def planned_over_measured(llm, tp, ep, own):
    # (plan's per-device weight bytes / measured, its state bytes / measured): KV, recurrent, MTP KV, snapshots
    r = llm.runner
    state = state_bytes_per_device(llm.cfg, r.num_pages, r.page_size, r.num_slots, llm.dtype,
                                   AbstractMesh((tp,), ("tp",)), r.state_positions, len(r.state.draft_kv),
                                   r.num_snapshots)
    measured = sum(x.addressable_shards[0].data.nbytes
                   for x in jax.tree.leaves((r.state.model, r.state.draft_kv, r.state.snapshots)))
    weights = plan(llm.cfg, llm.dtype, tp, ep, llm.num_mtp_layers).weights if own else None
    return [weights / own if own else None, state / measured]

root = sys.argv[1]
qwen = os.path.join(root, "qwen3_next")
write_random_checkpoint(qwen, {**TINY_RANDOM_CONFIG, "vocab_size": 512, "eos_token_id": 0, "linear_num_key_heads": 4,
                               "linear_num_value_heads": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16})
import hf_models
nemo = os.path.join(root, "nemotron_h")
hf_models.make_nemotron_h(nemo, blocks="M*E-", heads=4, kv_heads=2, mamba_heads=8, groups=4)
qwen35 = os.path.join(root, "qwen3_5_moe")       # separate in_proj_qkv (tiled q | k | v), fused experts, vision-wrapped
hf_models.make_qwen3_5(qwen35, moe=True, fused_experts=True, vision=True, k_heads=4, v_heads=8, dk=16, dv=16)
kw = dict(kernels="xla", max_num_seqs=2, max_model_len=64, max_prefill_chunk=16, page_size=8, progress=False,
          compile_cache_dir="")
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
out = {}
for name, path in (("qwen3_next", qwen), ("nemotron_h", nemo), ("qwen3_5_moe", qwen35)):
    for tp, ep in ((1, False), (2, False), (4, False), (2, True), (4, True)):
        regions.clear()
        llm = LLM(path, tensor_parallel_size=tp, enable_expert_parallel=ep, warmup=(tp == 2 and not ep), **kw)
        embed_reads = [share for p, share in regions if p == ("embed",)]
        compiles = llm.num_compiles
        tokens = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3, 4, 5], [9, 8, 7]], greedy)]
        tokens += [llm.generate([3, 1, 4, 1, 5, 9, 2, 6], seeded)[0].outputs[0].token_ids]
        split = []       # (param path, shard bytes * tp == bytes) for every leaf the rules split
        specs = {s.path: s for s in llm.engine.config.param_specs()}
        flat = jax.tree_util.tree_flatten_with_path(llm.runner.params)[0]
        own = total = 0
        for keys, x in flat:
            leaf = path_of(keys)
            total += x.nbytes
            own += x.addressable_shards[0].data.nbytes
            if tp > 1 and leaf in specs and any(partition(specs[leaf], llm.runner.mesh)):
                split.append([str(leaf), x.addressable_shards[0].data.nbytes * tp == x.nbytes])
        leaves = jax.tree.leaves(llm.runner.state)
        state = sum(x.addressable_shards[0].data.nbytes for x in leaves) / sum(x.nbytes for x in leaves)
        experts = [x.addressable_shards[0].data.shape[0] * tp == x.shape[0] for keys, x in flat
                   if path_of(keys)[-2:-1] == ("experts",)]
        out[f"{name}/{tp}" + ("/ep" if ep else "")] = {
            "tokens": tokens, "split": split, "per_device": own / total, "state": state, "experts_split": experts,
            "plan": planned_over_measured(llm, tp, ep, own), "embed_reads": embed_reads,
            "compiles_after_warmup": llm.num_compiles - compiles if tp == 2 else 0}
        del llm
# LoRA under tp (Qwen3-Next's GDN + attention projections; Nemotron-H's tiled Mamba2 in_proj: B tiled alike), and
# a scripted drafter's verify steps (drafts from the one-device output, the second of each wrong: rejections)
import torch
import transformers
from peft import LoraConfig, get_peft_model
from atlas_jax import LoRARequest
lora_targets = {"qwen3_next": r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj))",
                "nemotron_h": r"model\.layers\.\d+\.mixer\.(in_proj|q_proj|v_proj)"}
prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
for name, path in (("qwen3_next", qwen), ("nemotron_h", nemo)):
    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapter = os.path.join(root, f"lora_{name}")
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets[name],
                                    init_lora_weights=False)).save_pretrained(adapter)
    ref = out[f"{name}/1"]["tokens"]
    def propose(seq, k, ref=ref):
        want = ref[0] if seq.prompt_ids == prompts[0] else ref[1]
        n = len(seq.output_ids)
        return [t if j == 0 else (t + 1) % 100 for j, t in enumerate(want[n:n + k])]      # the second is wrong
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, enable_lora=True, max_loras=1, max_lora_rank=4, warmup=False, **kw)
        lora = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy,
                                                             lora_request=[LoRARequest("a", 1, adapter), None])]
        del llm
        llm = LLM(path, tensor_parallel_size=tp, speculative={"method": "scripted", "num_drafts": 2,
                                                              "propose": propose}, warmup=False, **kw)
        drafted = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        out[f"{name}/lora_spec/{tp}"] = {"lora": lora, "spec": drafted, "accepted": llm.spec_stats()["accepted"],
                                         "drafted": llm.spec_stats()["drafted"]}
        del llm
# the shipped model with its MTP head drafting: prefix caching (a second turn: prompt + reply + more hits), then
# swap preemption (two rows growing in a 9-page pool: one is swapped out and back)
prompt = [5, 17, 99, 3, 250, 12, 7, 64, 31, 8, 144, 2, 77, 301, 45, 9, 600, 21, 4, 88]
mtp = {"method": "mtp", "num_drafts": 2}
for tp in (1, 2):
    llm = LLM(tensor_parallel_size=tp, speculative=mtp, enable_prefix_caching=True, warmup=False, **kw)
    runs = [llm.generate(prompt, greedy)[0].outputs[0].token_ids]
    runs.append(llm.generate(prompt + runs[0] + [1, 2, 3], greedy)[0].outputs[0].token_ids)   # the next turn
    hit, accepted = llm.prefix_cache_stats()["hit_tokens"], llm.spec_stats()["accepted"]
    planned = planned_over_measured(llm, tp, False, 0)
    del llm
    llm = LLM(tensor_parallel_size=tp, speculative=mtp, warmup=False, **{**kw, "num_pages": 9})
    runs += [o.outputs[0].token_ids for o in llm.generate([prompt[:8], prompt[8:16]], SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True))]
    out[f"mtp_prefix_swap/{tp}"] = {"tokens": runs, "hit": hit, "accepted": accepted, "plan": planned,
                                    "preempted": sum(llm.engine.stats()["num_preemptions"].values())}
    del llm
print("RESULT " + json.dumps(out))
"""


FAMILIES = ["qwen3_next", "nemotron_h", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(WORKER, tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_one_device(results, family):
    one = results[f"{family}/1"]["tokens"]
    assert results[f"{family}/2"]["tokens"] == one and results[f"{family}/4"]["tokens"] == one


@pytest.mark.parametrize("family", FAMILIES)
def test_params_are_split(results, family):
    for tp in (2, 4):
        r = results[f"{family}/{tp}"]
        assert len(r["split"]) > 10 and all(ok for _, ok in r["split"]), r["split"]
        assert r["per_device"] < 1.1 / tp, r["per_device"]     # within 10% of total / tp (Mamba2's sectioned
                                                                # in_proj / conv and GDN's q | k | v tiled and split too)
        assert r["state"] < {2: 0.7, 4: 0.9}[tp], r["state"]       # KV pages and h pools by head (KV heads 2:
                                                                    # replicated at tp 4)
    assert results[f"{family}/2"]["compiles_after_warmup"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_loading_reads_each_shard_alone(results, family):
    """Under tp the loader reads each device's region of a split param (here the vocab-split embedding: tp
    regions of 1 / tp each), never the whole tensor; one device reads nothing region-wise."""
    assert results[f"{family}/1"]["embed_reads"] == []
    for tp in (2, 4):
        assert results[f"{family}/{tp}"]["embed_reads"] == [1 / tp] * tp


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel(results, family):
    """Experts split by expert (whole experts per device: the shard's leading axis is E / tp), tokens equal
    one device's (a dropped psum of the shards' partial sums changes them)."""
    one = results[f"{family}/1"]["tokens"]
    for tp in (2, 4):
        r = results[f"{family}/{tp}/ep"]
        assert r["tokens"] == one
        assert r["experts_split"] and all(r["experts_split"]), r["experts_split"]
        assert not any(results[f"{family}/{tp}"]["experts_split"])     # tp alone splits each expert's F instead


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_lora_and_drafted_verify_under_tp(results, family):
    one, two = results[f"{family}/lora_spec/1"], results[f"{family}/lora_spec/2"]
    assert two["lora"] == one["lora"] and one["lora"][0] != results[f"{family}/1"]["tokens"][0]   # the adapter acts
    assert two["lora"][1] == results[f"{family}/1"]["tokens"][1]                                  # the base row
    assert two["spec"] == one["spec"] == results[f"{family}/1"]["tokens"][:2]
    assert 0 < two["accepted"] < two["drafted"], two


def test_memory_plan_matches_measured_bytes(results):
    """scripts/plan_memory.py's numbers (parallel/memory_plan.py, from the config and the rules alone) against
    the per-device bytes of the sharded engines: weights, and the state (with the MTP head's KV and the
    prefix-cache snapshots in the MTP engine)."""
    checked = 0
    for key, r in results.items():
        for ratio in r.get("plan") or ():
            if ratio is not None:
                assert abs(ratio - 1) < 0.02, (key, r["plan"])
                checked += 1
    assert checked >= len(FAMILIES) * 10 + 2


def test_mtp_prefix_cache_and_swap_under_tp(results):
    one, two = results["mtp_prefix_swap/1"], results["mtp_prefix_swap/2"]
    assert two["tokens"] == one["tokens"] and one["hit"] == two["hit"]
    assert two["hit"] > 0 and two["accepted"] > 0 and two["preempted"] > 0, two
