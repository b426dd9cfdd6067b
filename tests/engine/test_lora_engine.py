"""Multi-LoRA serving through the engine (issue 16): PEFT adapters in the device pool, a batch mixing the base
model and several adapters in one compiled step, promotion with an LRU victim that is never a busy slot,
adapter-keyed prefix caching, and the refusals. The oracle is HF transformers + peft's own generate."""
from __future__ import annotations

import random

import pytest

import hf_models
from conftest import random_prompts

from atlas_jax import LLM, LoRARequest, SamplingParams
from atlas_jax.errors import InvalidRequestError
from atlas_jax.engine.lora import UnknownAdapterError
from atlas_jax.weights.lora import LoRAError

NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
QWEN3_ADAPTERS = {                       # name -> (target modules, r, alpha, rslora)
    "a": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8, False),
    "b": (["q_proj", "v_proj"], 2, 16, True),
    "c": (["o_proj", "down_proj", "up_proj"], 8, 8, False),
}
QWEN3_NEXT_ADAPTER = (r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj))",
                      4, 8, False)
# peft 0.21 on transformers 5 retargets any `*.down_proj` / `*.gate_proj` of a Qwen3-Next onto the routed experts'
# fused parameters, so an adapter of the shared expert alone is written by hand (PEFT's file layout) and its
# reference is HF with the adapter merged into the weights (W + scale * B @ A).
SHARED_EXPERT = [f"model.layers.{i}.mlp.shared_expert.{m}" for i in range(4) for m in ("gate_proj", "up_proj", "down_proj")]


def _make_adapters(maker, tmp, specs, seed=20):
    """Each adapter saved by peft (random A and B) on a fresh copy of the base model; returns
    {name: (LoRARequest, peft model)}."""
    from peft import LoraConfig, get_peft_model
    import torch
    out = {}
    for i, (name, (targets, r, alpha, rslora)) in enumerate(specs.items()):
        torch.manual_seed(seed + i)
        model = get_peft_model(maker(str(tmp / f"base_{name}")),
                               LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                                          use_rslora=rslora))
        model.save_pretrained(str(tmp / f"lora_{name}"))
        out[name] = (LoRARequest(name, i + 1, str(tmp / f"lora_{name}")), model)
    return out


@pytest.fixture(scope="module")
def qwen3_lora(ckpt_dir, tmp_path_factory):
    """A warmed Qwen3 engine with 2 adapter slots (prefix caching on), 3 adapters, and HF / peft greedy
    references for 3 prompts under the base model and each adapter."""
    path, base = ckpt_dir("qwen3_lora_engine", hf_models.make_qwen3)
    adapters = _make_adapters(hf_models.make_qwen3, tmp_path_factory.mktemp("qwen3_adapters"), QWEN3_ADAPTERS)
    prompts = random_prompts(128, [5, 19, 11], seed=7)
    refs = {None: [hf_models.hf_greedy(base, p, NEW) for p in prompts]}
    for name, (_, model) in adapters.items():
        refs[name] = [hf_models.hf_greedy(model, p, NEW) for p in prompts]
    llm = LLM(path, dtype="float32", page_size=4, max_num_seqs=4, max_model_len=64, max_prefill_chunk=16,
              max_num_batched_tokens=32, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
              enable_prefix_caching=True, warmup=True, progress=False, compile_cache_dir="")
    return llm, {n: a[0] for n, a in adapters.items()}, prompts, refs


def test_adapters_change_the_base_models_tokens(qwen3_lora):
    _, _, prompts, refs = qwen3_lora
    for name in QWEN3_ADAPTERS:
        assert refs[name] != refs[None]                  # a non-trivial adapter: the oracle's tokens differ
    assert refs["a"] != refs["b"] != refs["c"]


def test_one_batch_mixing_base_and_adapters_matches_peft(qwen3_lora):
    """Base, a and b rows in one batch (2 slots: both adapters resident at once), each equal to HF / peft."""
    llm, reqs, prompts, refs = qwen3_lora
    cases = [(p, None if name is None else reqs[name], name, i) for name in (None, "a", "b")
             for i, p in enumerate(prompts)]
    random.Random(0).shuffle(cases)
    outs = llm.generate([c[0] for c in cases], GREEDY, lora_request=[c[1] for c in cases])
    for (_, _, name, i), out in zip(cases, outs):
        assert out.outputs[0].token_ids == refs[name][i], (name, i)


def test_victim_policy_never_evicts_a_busy_slot(qwen3_lora):
    """2 slots, 3 adapters, many concurrent requests: adapters are promoted and evicted as demand moves,
    never out of a slot a running sequence holds; every request gets its own adapter's tokens (also after
    a cached prefix under another adapter), and nothing compiles after warm-up."""
    llm, reqs, prompts, refs = qwen3_lora
    manager, ops = llm.engine.lora, llm.engine.runner.state_ops
    loads, load_adapter = [], ops.load_adapter

    def watched(slot, weights):
        # every sequence holding the slot runs the adapter being loaded (none of its old one's is left)
        holders = {s.cache_key for s in llm.engine.scheduler.running if s.adapter_slot == slot}
        loads.append((slot, holders <= {manager.slot_uid[slot]}))
        load_adapter(slot, weights)
    ops.load_adapter = watched
    compiles = llm.num_compiles
    try:
        rng = random.Random(1)
        cases = [(rng.choice([None, "a", "b", "c"]), rng.randrange(3)) for _ in range(24)]
        outs = llm.generate([prompts[i] for _, i in cases], GREEDY,
                            lora_request=[None if n is None else reqs[n] for n, _ in cases])
    finally:
        del ops.load_adapter
    for (name, i), out in zip(cases, outs):
        assert out.outputs[0].token_ids == refs[name][i], (name, i)
    assert len(loads) >= 3 and all(ok for _, ok in loads)      # evictions happened, none of a busy slot
    assert manager.refcount == [0, 0, 0]
    stats = llm.engine.stats()["lora"]
    assert stats["refcounts"] == [0, 0] and stats["num_promotions"] >= len(loads)
    assert llm.num_compiles == compiles


def test_prefix_cache_is_keyed_by_adapter(qwen3_lora):
    """The same prompt under the base model, then adapter c, then the base again: the cache never hands
    KV computed under one to the other (prefix caching is on in this engine)."""
    llm, reqs, prompts, refs = qwen3_lora
    llm.reset_prefix_cache()
    assert llm.generate(prompts[1], GREEDY)[0].outputs[0].token_ids == refs[None][1]
    out = llm.generate(prompts[1], GREEDY, lora_request=reqs["c"])[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == refs["c"][1]
    again = llm.generate(prompts[1], GREEDY, lora_request=reqs["c"])[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == refs["c"][1]


def test_refusals(qwen3_lora, tmp_path):
    llm, reqs, prompts, _ = qwen3_lora
    with pytest.raises(UnknownAdapterError, match="'nope' is not loaded"):
        llm.generate(prompts[0], GREEDY, lora_request=LoRARequest("nope", 9))
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        llm.generate(prompts[0], GREEDY, lora_request=LoRARequest("missing", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, str(tmp_path))
    # an adapter in use cannot be unloaded; once its request ends it can
    req = llm.engine.add_request(prompts[0], GREEDY, lora_request=reqs["a"])
    with pytest.raises(LoRAError, match="in use"):
        llm.remove_lora("a")
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert req.finished
    assert llm.remove_lora("a") and "a" not in [r.lora_name for r in llm.list_loras()]
    with pytest.raises(UnknownAdapterError):
        llm.generate(prompts[0], GREEDY, lora_request="a")
    assert llm.add_lora(reqs["a"])                      # registered again (a new cache key)


def test_rank_above_the_maximum_is_refused(qwen3_lora, tmp_path):
    llm, _, prompts, _ = qwen3_lora
    big = _make_adapters(hf_models.make_qwen3, tmp_path, {"big": (["q_proj"], 16, 16, False)})["big"][0]
    with pytest.raises(InvalidRequestError, match="rank 16 .* exceeds max_lora_rank 8"):
        llm.generate(prompts[0], GREEDY, lora_request=big)


def test_an_adapter_changed_on_disk_after_eviction_fails_only_its_requests(qwen3_lora, tmp_path):
    """An adapter dropped from the host cache (max_cpu_loras 2) whose files are then damaged: the next
    request naming it is refused (AdapterUnavailableError), re-validated off the engine, and the engine
    goes on serving the base model and the other adapters with their exact tokens; repaired files serve
    again."""
    import os
    import shutil

    from atlas_jax.engine.lora import AdapterUnavailableError
    llm, reqs, prompts, refs = qwen3_lora
    manager = llm.engine.lora
    shutil.copytree(reqs["c"].lora_path, tmp_path / "x")
    x = LoRARequest("x", 11, str(tmp_path / "x"))
    assert llm.generate(prompts[0], GREEDY, lora_request=x)[0].outputs[0].token_ids == refs["c"][0]
    llm.generate([prompts[0], prompts[1]], GREEDY, lora_request=[reqs["a"], reqs["b"]])
    uid = manager.lookup("a")[1]                 # (a lookup of another adapter; x is the least recent)
    assert len(manager._host) == 2 and all(e.uid not in manager._host for n, e in manager._registry.items()
                                           if n == "x"), uid
    weights = tmp_path / "x" / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:len(good) // 2])
    with pytest.raises(AdapterUnavailableError, match="could not be reloaded"):
        llm.generate(prompts[0], GREEDY, lora_request="x")
    config = tmp_path / "x" / "adapter_config.json"
    good_config = config.read_bytes()
    for f in (weights, config):                               # a valid adapter, but not the one registered
        shutil.copy(os.path.join(reqs["a"].lora_path, f.name), f)
    with pytest.raises(AdapterUnavailableError, match="changed on disk"):
        llm.generate(prompts[0], GREEDY, lora_request="x")
    config.write_bytes(good_config)
    outs = llm.generate([prompts[2], prompts[2]], GREEDY, lora_request=[None, reqs["a"]])
    assert [o.outputs[0].token_ids for o in outs] == [refs[None][2], refs["a"][2]]
    weights.write_bytes(good)
    assert llm.generate(prompts[1], GREEDY, lora_request="x")[0].outputs[0].token_ids == refs["c"][1]
    llm.remove_lora("x")


def test_a_made_request_keeps_its_adapters_host_copy(qwen3_lora, tmp_path):
    """Between a request's lookup (its thread) and its submit (the engine thread) other registrations fill
    the host cache (max_cpu_loras 2): the request's adapter stays in host memory (pinned), so the engine
    serves it exactly; the pin goes when the request does."""
    import gc
    import shutil
    llm, reqs, prompts, refs = qwen3_lora
    manager = llm.engine.lora
    shutil.copytree(reqs["c"].lora_path, tmp_path / "w")
    w = LoRARequest("w", 13, str(tmp_path / "w"))
    req = llm.engine.make_request(prompts[2], GREEDY, lora_request=w)
    uid = req.lora[1]
    for i, name in enumerate(("p", "q")):                      # two newer registrations: LRU would drop w
        shutil.copytree(reqs["a"].lora_path, tmp_path / name)
        llm.add_lora(LoRARequest(name, 20 + i, str(tmp_path / name)))
    assert uid in manager._host
    llm.engine.submit(req)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert req.seqs[0].output_ids == refs["c"][2] and req.seqs[0].finish_reason == "length"
    del req
    gc.collect()
    assert manager._registry["w"].pinned == 0 and manager._registry["w"].in_use == 0
    for name in ("w", "p", "q"):
        llm.remove_lora(name)


def test_a_failing_adapter_slot_update_fails_only_its_request(qwen3_lora):
    """The device update of an adapter slot raises (as a wrong-shape adapter did before validation): the
    request that needed it finishes with "error", its batch mates get their exact tokens, the slot table
    is left as it was, and the same adapter loads fine afterwards."""
    llm, reqs, prompts, refs = qwen3_lora
    manager = llm.engine.lora
    y = LoRARequest("y", 12, reqs["b"].lora_path)
    llm.add_lora(y)
    ops, table = llm.engine.runner.state_ops, list(manager.slot_uid)

    def broken(slot, weights):
        raise ValueError("Incompatible types for broadcasting")
    ops.load_adapter = broken
    try:
        outs = llm.generate([prompts[0], prompts[1], prompts[2]], GREEDY, lora_request=[None, y, None])
    finally:
        del ops.load_adapter
    assert outs[1].outputs[0].finish_reason == "error" and "broadcasting" in outs[1].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [refs[None][0], refs[None][2]]
    assert all(u == t or u is None for u, t in zip(manager.slot_uid, table)) and manager.refcount == [0, 0, 0]
    assert llm.generate(prompts[1], GREEDY, lora_request=y)[0].outputs[0].token_ids == refs["b"][1]
    assert not llm.engine.requests and llm.blocks.num_free == llm.num_pages
    llm.remove_lora("y")


def test_engine_without_lora_refuses_adapters(default_llm):
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        default_llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("a", 1, "/nonexistent"))


def _merged_adapter(hf, path, modules, r, alpha, seed):
    """A PEFT-format adapter on `modules` with random A, B written by hand; returns `hf` with it merged in."""
    import json
    import os

    import numpy as np
    import torch
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors, named = {}, dict(hf.named_modules())
    for m in modules:
        w = named[m].weight
        a = rng.standard_normal((r, w.shape[1])).astype(np.float32) * 0.3
        b = rng.standard_normal((w.shape[0], r)).astype(np.float32) * 0.3
        tensors[f"base_model.model.{m}.lora_A.weight"], tensors[f"base_model.model.{m}.lora_B.weight"] = a, b
        with torch.no_grad():
            w += torch.from_numpy(b @ a * (alpha / r))
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["gate_proj", "up_proj",
                   "down_proj"], "bias": "none", "task_type": "CAUSAL_LM"}, f)
    return hf


def test_qwen3_next_adapters_on_gdn_and_shared_expert_match_hf(ckpt_dir, tmp_path):
    """GDN + attention projections (peft) and the MoE's shared expert (merged-weights reference) adapted:
    base, a and b rows mixed in one batch equal HF greedy each."""
    path, base = ckpt_dir("qwen3_next_lora_engine", hf_models.make_qwen3_next)
    adapters = _make_adapters(hf_models.make_qwen3_next, tmp_path, {"a": QWEN3_NEXT_ADAPTER})
    merged = _merged_adapter(hf_models.make_qwen3_next(str(tmp_path / "base_b")), str(tmp_path / "lora_b"),
                             SHARED_EXPERT, r=6, alpha=12, seed=5)
    adapters["b"] = (LoRARequest("b", 2, str(tmp_path / "lora_b")), merged)
    prompts = random_prompts(128, [6, 13], seed=8)
    llm = LLM(path, dtype="float32", page_size=4, max_num_seqs=8, max_model_len=64, max_prefill_chunk=16,
              enable_lora=True, max_loras=2, max_lora_rank=8, warmup=False, progress=False, compile_cache_dir="")
    cases = [(p, name) for name in (None, "a", "b") for p in prompts]
    outs = llm.generate([p for p, _ in cases], GREEDY,
                        lora_request=[None if n is None else adapters[n][0] for _, n in cases])
    for (p, name), out in zip(cases, outs):
        ref = hf_models.hf_greedy(base if name is None else adapters[name][1], p, NEW)
        assert out.outputs[0].token_ids == ref, name
        if name is not None:
            assert ref != hf_models.hf_greedy(base, p, NEW)


@pytest.fixture(scope="module")
def lora_server(qwen3_lora):
    """The app in-process on the LoRA engine, driven by the official openai client (its httpx client is the
    app's TestClient)."""
    import openai
    from fastapi.testclient import TestClient

    from atlas_jax.engine.async_llm import AsyncLLM
    from atlas_jax.server.app import build_app
    llm, reqs, _, _ = qwen3_lora
    for r in reqs.values():
        llm.add_lora(r)
    engine = AsyncLLM.from_llm(llm)
    try:
        with TestClient(build_app(engine, served_model_name="tiny", allow_runtime_lora_updating=True)) as http:
            yield http, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    finally:
        engine.shutdown()


def test_server_chooses_the_adapter_by_model(qwen3_lora, lora_server):
    import openai
    _, _, prompts, refs = qwen3_lora
    http, client = lora_server
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {"tiny", "a", "b", "c"} and models["b"].parent == "tiny"
    for model, name in (("tiny", None), ("a", "a"), ("c", "c")):
        out = client.completions.create(model=model, prompt=prompts[2], max_tokens=NEW, temperature=0.0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.model == model and out.choices[0].token_ids == refs[name][2]
    stream = client.completions.create(model="b", prompt=prompts[0], max_tokens=NEW, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [t for chunk in stream for t in chunk.choices[0].token_ids] == refs["b"][0]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=prompts[0], max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_server_loads_and_unloads_adapters(qwen3_lora, lora_server):
    _, reqs, prompts, refs = qwen3_lora
    http, client = lora_server
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": reqs["c"].lora_path})
    assert r.status_code == 200, r.text
    assert "d" in [m.id for m in client.models.list().data]
    out = client.completions.create(model="d", prompt=prompts[1], max_tokens=NEW, temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].token_ids == refs["c"][1]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "/x"}).status_code == 400
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 404
    assert http.post("/v1/completions", json={"model": "d", "prompt": prompts[1], "max_tokens": 2}).status_code == 404
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "d"}).status_code == 400      # no path


def _damaged_adapters(base: str, tmp_path) -> dict:
    """name -> adapter directory damaged one way each, from a good adapter at `base`."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file
    out = {}
    for name in ("wide", "nan", "truncated"):
        out[name] = tmp_path / name
        shutil.copytree(base, out[name])
    file = "adapter_model.safetensors"
    tensors = load_file(str(tmp_path / "wide" / file))
    save_file({k: np.concatenate([v, v], axis=1) if ".lora_A." in k else v for k, v in tensors.items()},
              str(tmp_path / "wide" / file))            # A's in-dim doubled: trained for another model size
    save_file({k: np.full_like(v, np.nan) if ".lora_B." in k else v for k, v in tensors.items()},
              str(tmp_path / "nan" / file))
    data = (tmp_path / "truncated" / file).read_bytes()
    (tmp_path / "truncated" / file).write_bytes(data[:len(data) - 64])
    return out


def test_server_refuses_damaged_adapters_and_stays_healthy(qwen3_lora, lora_server, tmp_path):
    """Wrong-shape, NaN and truncated adapters loaded over HTTP: 400 naming the problem, nothing
    registered; a canary's tokens are unchanged and /health stays 200. Runtime loading is refused
    (403) on a server started without --allow-runtime-lora-updating."""
    from fastapi.testclient import TestClient

    from atlas_jax.server.app import build_app
    _, reqs, prompts, refs = qwen3_lora
    http, client = lora_server
    for name, path in _damaged_adapters(reqs["a"].lora_path, tmp_path).items():
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        want = {"wide": "lora_A has shape", "nan": "NaN", "truncated": "cannot be read"}[name]
        assert r.status_code == 400 and want in r.json()["error"]["message"], (name, r.text)
        assert name not in [m.id for m in client.models.list().data]
    assert http.get("/health").status_code == 200
    out = client.completions.create(model="a", prompt=prompts[0], max_tokens=NEW, temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].token_ids == refs["a"][0]
    locked = TestClient(build_app(http.app.state.engine, served_model_name="tiny"))
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = locked.post(path, json={"lora_name": "z", "lora_path": reqs["a"].lora_path})
        assert r.status_code == 403 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]


def test_server_refuses_to_unload_an_adapter_in_use(qwen3_lora, lora_server):
    """Unloading an adapter while a request streams under it is refused (409); the request finishes intact."""
    import threading
    llm, reqs, prompts, refs = qwen3_lora
    http, client = lora_server
    status, started, release = [], threading.Event(), threading.Event()
    real_step = llm.engine.step

    def slow_step():
        started.set()
        release.wait(10)
        return real_step()
    llm.engine.step = slow_step
    try:
        def unload():
            started.wait(10)
            status.append(http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code)
            release.set()
        t = threading.Thread(target=unload)
        t.start()
        out = client.completions.create(model="b", prompt=prompts[2], max_tokens=NEW, temperature=0.0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        t.join()
    finally:
        llm.engine.step = real_step
    assert status == [409] and out.choices[0].token_ids == refs["b"][2]


def test_serve_cli_lora_modules(ckpt_dir):
    from atlas_jax.serve import main, parse_lora_modules
    reqs = parse_lora_modules(["a=/x/y", '{"name": "b", "path": "/z"}'])
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in reqs] == [("a", 1, "/x/y"), ("b", 2, "/z")]
    for bad in (["a"], ["a=/x", "a=/y"], ['{"name": "b"}']):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
    path, _ = ckpt_dir("qwen3_lora_engine", hf_models.make_qwen3)
    with pytest.raises(SystemExit, match="needs --enable-lora"):
        main(["--model", path, "--lora-modules", "a=/x"])
    with pytest.raises(SystemExit, match="a=/nonexistent: no adapter_config.json"):
        main(["--model", path, "--enable-lora", "--lora-modules", "a=/nonexistent", "--dtype", "float32",
              "--compile-cache-dir", ""])
