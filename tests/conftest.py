import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import hf_models  # noqa: E402


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
