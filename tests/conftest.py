import atexit
import contextlib
import os
import random
import shutil
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compile cache for the test run, in a fresh directory: the suite builds many engines of
# the same shapes (each pytest process its shared default engine, the server tests a process of that shape),
# and a cache hit replaces a compile. scripts/run_tests.sh gives both of its pytest processes one directory
# (ATLAS_JAX_TEST_CACHE, removed after the run); a plain pytest run makes its own, removed at exit.
_CACHE_HOME = os.environ.get("ATLAS_JAX_TEST_CACHE")
if not _CACHE_HOME:
    _CACHE_HOME = tempfile.mkdtemp(prefix="atlas_jax_tests_")
    atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)
os.environ["ATLAS_JAX_HOME"] = _CACHE_HOME
os.environ.pop("ATLAS_JAX_DISABLE_COMPILE_CACHE", None)
sys.path.insert(0, os.path.dirname(__file__))          # tests import hf_models (the torch oracle) by name

from atlas_jax.engine.llm import default_compile_cache_dir, enable_compile_cache  # noqa: E402

enable_compile_cache(default_compile_cache_dir())      # for every engine, compile_cache_dir="" ones included
import jax  # noqa: E402

# A size bound turns on the cache's file lock: pytest-xdist workers share the directory, and an unlocked
# write could be read half-written by the other worker.
jax.config.update("jax_compilation_cache_max_size", 16 << 30)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

SEED_ENV = "ATLAS_JAX_TEST_SEED"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """One seed per run for every hypothesis test (a fresh one unless given), shared with the xdist workers
    through the environment and printed at the end: `ATLAS_JAX_TEST_SEED=N` reruns the same draws."""
    if config.getoption("hypothesis_seed", None) is None:
        seed = os.environ.get(SEED_ENV) or str(random.SystemRandom().randrange(2 ** 31))
        os.environ[SEED_ENV] = config.option.hypothesis_seed = seed


def pytest_terminal_summary(terminalreporter, config):
    seed = config.getoption("hypothesis_seed", None)
    terminalreporter.write_line(f"hypothesis seed {seed}: rerun the same examples with {SEED_ENV}={seed}")



@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """Session cache of tiny HF checkpoints: ckpt_dir(name, maker, **kw) -> (path, hf_model)."""
    made = {}

    def get(name, maker, **kw):
        if name not in made:
            path = str(tmp_path_factory.mktemp(name))
            made[name] = (path, maker(path, **kw))
        return made[name]
    return get


def random_prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The tiny random Qwen3-Next checkpoint (GDN + attention + MoE + MTP head, vocab 512)."""
    from atlas_jax.default_model import write_tiny_random_model
    path = str(tmp_path_factory.mktemp("tiny-qwen3-next"))
    write_tiny_random_model(path)
    return path


@pytest.fixture(scope="session")
def default_llm(tiny_model_path):
    """The tiny random Qwen3-Next on one warmed-up engine, shared by every engine-level test module
    (compiling is the expensive part). Prefix caching is on, so every test on it also checks that
    caching changes no output (tests repeat prompts and compare), and the no-compiles-after-warm-up
    test covers hits, snapshots and forks."""
    from atlas_jax import LLM
    return LLM(tiny_model_path, dtype="float32", page_size=8, max_num_seqs=8, max_model_len=128,
               max_prefill_chunk=64, max_num_batched_tokens=128, warmup=True, progress=False,
               enable_prefix_caching=True)


SPEC_ENGINE = dict(dtype="float32", page_size=8, max_num_seqs=4, max_model_len=160, max_prefill_chunk=64,
                   max_num_batched_tokens=128, warmup=False, compile_cache_dir="", progress=False)


@pytest.fixture(scope="module")     # module scope: their executables are freed with the module (map-count limit)
def spec_pair(ckpt_dir):
    """spec_pair(family) -> (base, spec) for "qwen3_next" / "nemotron_h" / "qwen3": a tiny checkpoint (init
    0.2, slow GDN / Mamba2 decay: a wrong state changes tokens) on a plain engine and on a speculative one
    (3 drafts; self-speculative for the hybrids, ngram for Qwen3) built with prefix caching, switched off
    until a test turns it on. Tests swap its drafter (`engine.proposer`); built once per module (later modules load the
    compiled steps from the run's persistent compile cache)."""
    import hf_models
    from atlas_jax import LLM
    made = {}

    def get(family):
        if family not in made:
            maker = {"qwen3_next": hf_models.make_qwen3_next, "qwen3": hf_models.make_qwen3,
                     "nemotron_h": hf_models.make_nemotron_h}[family]
            path, _ = ckpt_dir(f"{family}_spec", maker, vocab=256, init_std=0.2)
            method = "ngram" if family == "qwen3" else "self"
            spec = LLM(path, speculative={"method": method, "num_drafts": 3}, enable_prefix_caching=True,
                       **SPEC_ENGINE)
            spec.engine.set_prefix_caching(False)
            made[family] = (LLM(path, **SPEC_ENGINE), spec)
        return made[family]
    return get


@contextlib.contextmanager
def serving(app, **config):
    """uvicorn serving `app` in a thread on a free loopback port (real sockets); yields the port.
    config: more uvicorn.Config keywords (e.g. http=server.connections.protocol_class(...))."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A module's SLOW_IDS (test id prefixes) mark those parametrized cases slow: the default run keeps a
    representative subset of a matrix, `-m slow` runs the rest."""
    for item in items:
        if any(item.name.startswith(p) for p in getattr(item.module, "SLOW_IDS", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    """After each module, drop jax's caches of compiled executables (engines keep their own). Each live
    XLA:CPU executable holds ~9 memory mappings; a whole half of the suite accumulates thousands, and at
    vm.max_map_count (65530) the next compile or cache write aborts the process (seen as SIGABRT inside
    `compile` / `serialize` late in long runs)."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()
