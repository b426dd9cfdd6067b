"""EngineArgs is the one engine configuration: every field has a CLI flag on serve and generate
(generated, with its help), parsed flags round-trip into the fields LLM takes, and a misspelt LLM
keyword is an error naming it."""
import argparse
import dataclasses

import pytest

from atlas_jax import LLM
from atlas_jax.engine.args import EngineArgs
from atlas_jax.engine.speculative import SpeculativeConfig
from atlas_jax.serve import parse_args


def test_every_field_is_a_serve_flag_with_help():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(EngineArgs):
        assert f.name in actions and actions[f.name].help, f.name
    args = parse_args(["--max-prefill-rows", "2", "--swap-space", "1.5", "--seed", "7", "--no-load-mtp",
                       "--compile-cache-dir", "", "--speculative", "ngram:3", "--kernels", "xla"])
    ea = EngineArgs.from_cli(args)
    assert (ea.max_prefill_rows, ea.swap_space_gb, ea.seed, ea.load_mtp, ea.compile_cache_dir, ea.kernels) == \
        (2, 1.5, 7, False, "", "xla")
    assert ea.speculative == SpeculativeConfig.parse({"method": "ngram", "num_drafts": 3})
    assert set(ea.engine_kwargs()) == {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    with pytest.raises(ValueError, match="--speculative"):
        EngineArgs.from_cli(parse_args(["--speculative", "bogus"]))


def test_generate_has_the_engine_flags_and_its_own_sampling_seed():
    from atlas_jax.generate import SAMPLING_FLAGS, parse_args as generate_args
    args = generate_args(["--seed", "3", "--max-num-seqs", "2", "--prompt", "x"])
    engine = EngineArgs.from_cli(args, skip=SAMPLING_FLAGS)
    assert args.seed == 3 and engine.seed == 0 and engine.max_num_seqs == 2


def test_llm_refuses_unknown_keywords():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_kv_cache_memory_sizes_the_pool_from_llm_and_the_cli(tiny_model_path):
    """kv_cache_memory (GiB) is an EngineArgs field: LLM takes it, serve and generate have the flag."""
    from atlas_jax.engine.sizing import pages_for_memory
    from atlas_jax.state.cache import state_bytes
    llm = LLM(tiny_model_path, dtype="float32", page_size=8, max_num_seqs=2, max_model_len=64, warmup=False,
              compile_cache_dir="", kv_cache_memory=0.001)
    per_page = state_bytes(llm.cfg, 2, 8, 1, llm.dtype) - state_bytes(llm.cfg, 1, 8, 1, llm.dtype)
    assert llm.num_pages == int(0.001 * 2**30 // per_page) == pages_for_memory(llm.cfg, llm.dtype, 8, 0.001)
    assert EngineArgs.from_cli(parse_args(["--kv-cache-memory", "2.5"])).kv_cache_memory == 2.5
    with pytest.raises(ValueError, match="not both"):
        LLM(tiny_model_path, dtype="float32", num_pages=8, kv_cache_memory=1.0, warmup=False, compile_cache_dir="")


def test_max_num_seqs_defaults_to_what_fits_in_memory(tiny_model_path):
    """Unset, max_num_seqs is as many sequences as half the free memory holds (CPU; 90% on accelerators),
    capped at 32 on CPU and 256 elsewhere. A sequence's bytes are measured on real engines: the state of a
    2-sequence engine less a 1-sequence one's (KV pages for max_model_len, recurrent slot, penalty row)."""
    import jax
    from atlas_jax.engine.sizing import default_max_num_seqs
    kw = dict(dtype="float32", page_size=8, max_model_len=64, warmup=False, compile_cache_dir="")
    llms = [LLM(tiny_model_path, max_num_seqs=n, **kw) for n in (1, 2)]
    per_seq = int(jnp_bytes(llms[1].runner.state) - jnp_bytes(llms[0].runner.state))
    cfg, dtype = llms[0].cfg, llms[0].dtype
    assert default_max_num_seqs(cfg, dtype, 8, 64, None, free_bytes=2 * 10 * per_seq, platform="cpu") == 10
    assert default_max_num_seqs(cfg, dtype, 8, 64, None, free_bytes=2 * 10 * per_seq - 1, platform="cpu") == 9
    assert default_max_num_seqs(cfg, dtype, 8, 64, None, free_bytes=10**15, platform="cpu") == 32
    assert default_max_num_seqs(cfg, dtype, 8, 64, None, free_bytes=10**15, platform="gpu") == 256
    assert default_max_num_seqs(cfg, dtype, 8, 64, None, free_bytes=0, platform="cpu") == 1
    assert default_max_num_seqs(cfg, dtype, 8, 64, 5, free_bytes=10**15, platform="cpu") == 5   # a page each
    assert LLM(tiny_model_path, **kw).max_num_seqs == 32 and jax.default_backend() == "cpu"    # this machine fits 32


def jnp_bytes(tree) -> int:
    import jax
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name,value", [("page_size", 0), ("max_num_seqs", -1), ("max_model_len", 2.5),
                                        ("max_prefill_chunk", True), ("max_prefill_rows", 0),
                                        ("max_num_batched_tokens", -4), ("num_pages", 0)])
def test_engine_config_refuses_non_positive_sizes(tiny_model_path, name, value):
    """EngineConfig.create validates every size knob before anything is allocated, naming it."""
    with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
        LLM(tiny_model_path, dtype="float32", warmup=False, compile_cache_dir="", **{name: value})


@pytest.mark.parametrize("tp,message", [(0, "tensor_parallel_size must be a positive integer"),
                                        (3, "num_attention_heads = 4 is not divisible by tensor_parallel_size 3"),
                                        (2, "tensor_parallel_size 2 needs that many devices; 1 are visible")])
def test_tensor_parallel_size_is_checked(tiny_model_path, tp, message):
    """A mesh the model's head / vocabulary counts do not divide, or more devices than there are, is refused
    before anything is allocated, naming the field (the split itself: tests/engine/test_tensor_parallel.py)."""
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_path, dtype="float32", warmup=False, compile_cache_dir="", tensor_parallel_size=tp)


@pytest.mark.parametrize("kw,message", [
    ({"data_parallel_size": 0}, "data_parallel_size must be a positive integer"),
    ({"data_parallel_size": 2}, "data_parallel_size x tensor_parallel_size 2 needs that many devices; 1 are visible"),
    ({"data_parallel_size": 2, "tensor_parallel_size": 2}, "x tensor_parallel_size 4 needs that many devices"),
    ({"data_parallel_size": 2, "enable_lora": True}, "does not support enable_lora yet"),
    ({"data_parallel_size": 2, "enable_prompt_logprobs": True}, "does not support enable_prompt_logprobs yet")])
def test_data_parallel_size_is_checked(tiny_model_path, kw, message):
    """A data-parallel layout the devices cannot hold, or with a feature data parallel does not serve yet, is
    refused before anything is loaded, naming it (data parallel itself: tests/engine/test_data_parallel.py)."""
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_path, dtype="float32", warmup=False, compile_cache_dir="", **kw)


@pytest.mark.parametrize("kw,message", [
    ({"nnodes": 2}, "nnodes 2 needs dist_init_addr HOST:PORT"),
    ({"nnodes": 2, "dist_init_addr": "nohost"}, "needs dist_init_addr HOST:PORT"),
    ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "127.0.0.1:1"}, r"node_rank must be in \[0, nnodes = 2\)"),
    ({"nnodes": 0}, "nnodes must be a positive integer"),
    ({"dist_timeout": 0}, "dist_timeout must be a positive integer")])
def test_multihost_arguments_are_checked_before_joining(tiny_model_path, kw, message):
    """A bad multi-host layout is refused before jax.distributed is contacted (the join itself:
    tests/server/test_multihost.py)."""
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_path, dtype="float32", warmup=False, compile_cache_dir="", **kw)


@pytest.mark.parametrize("cli", ["atlas_jax.serve", "atlas_jax.generate"])
def test_help_lists_every_engine_flag(cli):
    """--help renders (a help text with '%' once crashed argparse) and names every EngineArgs flag."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", cli, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for f in dataclasses.fields(EngineArgs):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        assert flag in out.stdout or f.name == "model", flag
