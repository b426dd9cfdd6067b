"""The shipped default model, atlas-tiny: a real HF-format checkpoint inside the package that `LLM()`
loads with no model given, that transformers loads with the same logits as ours, whose tokenizer and
chat template render as transformers renders them, and that models code outside its training data at
the bits per byte its card states."""
import math
import os

import jinja2
import numpy as np
import pytest
import torch

import atlas_jax
from atlas_jax import LLM
from atlas_jax.default_model import default_model_path
from atlas_jax.frontend.chat import ChatTemplate

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
         "generation_config.json", "README.md", "draft_token_map.json")


@pytest.fixture(scope="module")
def shipped():
    """LLM() with no model: the shipped checkpoint (scoring only, nothing warmed up)."""
    return LLM(dtype="float32", max_num_seqs=1, max_model_len=1024, max_prefill_chunk=512, warmup=False,
               progress=False, compile_cache_dir="")


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def test_default_checkpoint_is_shipped_whole(shipped):
    path = default_model_path()
    assert shipped.model_path == path and path.startswith(os.path.dirname(os.path.realpath(atlas_jax.__file__)))
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in FILES}
    assert sum(sizes.values()) < 40e6
    assert shipped.num_mtp_layers == 1                            # the MTP head is loaded for speculation
    assert shipped.cfg.model_type == "qwen3_next" and shipped.cfg.gdn_layers and shipped.cfg.attention_layers
    assert shipped.cfg.num_experts > 1
    from atlas_jax.engine.speculative import SpeculativeConfig, load_token_map
    ids = load_token_map(SpeculativeConfig.parse({"method": "mtp"}), path, shipped.cfg.vocab_size)
    assert len(set(ids.tolist())) == len(ids) == 1024                # the MTP head's draft vocabulary (FR-Spec)


def test_transformers_logits_and_bits_per_byte_outside_the_stdlib(shipped, hf):
    """The same tokens and logits in transformers as in the engine on code the model never saw (jinja2's
    source); from those logits, bits per byte <= 2.5 (the card's claim)."""
    model, tokenizer = hf
    with open(os.path.join(os.path.dirname(jinja2.__file__), "utils.py")) as f:
        text = f.read()[:6000]
    ids = tokenizer(text)["input_ids"][:512]
    assert ids == shipped.tokenizer.encode(text)[:512]
    ours = shipped.prompt_logits(ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=1e-3)
    top = ours.max(-1, keepdims=True)
    logp = ours - top - np.log(np.sum(np.exp(ours - top), -1, keepdims=True))
    nats = -np.sum(logp[np.arange(len(ids) - 1), ids[1:]])
    scored_bytes = len(tokenizer.decode(ids[1:]).encode())
    assert nats / math.log(2) / scored_bytes <= 2.5


def test_chat_template_and_special_tokens_as_transformers_renders_them(shipped, hf):
    _, tokenizer = hf
    chat = [{"role": "system", "content": "You complete Python code."},
            {"role": "user", "content": "def add(a, b):"}]
    ours = ChatTemplate.for_model(shipped.model_path).render(chat)
    theirs = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours == theirs and ours.endswith("<|im_start|>assistant\n")
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(shipped.tokenizer.encode(special)) == 1
    assert shipped.tokenizer.encode(ours) == tokenizer(ours)["input_ids"]
