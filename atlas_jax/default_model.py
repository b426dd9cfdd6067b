"""The embedded default model, and tiny random checkpoints for tests and benchmarks.

`default_model_path()` is atlas-tiny, shipped inside the package (assets/atlas-tiny: config.json,
model.safetensors with an MTP head, tokenizer.json, chat_template.jinja, README.md = the model card):
a ~10M-parameter Qwen3-Next trained by scripts/train_tiny.py on the Python standard library. It is what
`LLM()`, `python -m atlas_jax.serve` and `python -m atlas_jax.generate` load when no model is given.

`write_tiny_random_model(path)` writes a deterministic random-init Qwen3-Next at test scale (hidden 128,
vocab 512, an MTP head) as a real HF-format checkpoint: tests and benchmarks exercise the engine on it,
where compile time, not text quality, is what matters.
"""
from __future__ import annotations

import json
import os

import numpy as np

DEFAULT_MODEL = "atlas-tiny"
_SEED = 20261129

TINY_RANDOM_CONFIG = {  # config.json of the random test model (vocab and special ids come from the tokenizer)
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "full_attention_interval": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "num_nextn_predict_layers": 1, "torch_dtype": "float32",
}

_CORPUS = """\
def add(a, b):
    return a + b

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

The quick brown fox jumps over the lazy dog. A hybrid language model mixes full attention
with linear attention layers; the recurrent state of a Gated DeltaNet layer is a matrix per
head, updated by every token. Hello, world! What is the capital of France? Paris is the
capital of France. 0 1 2 3 4 5 6 7 8 9 10 100 1000
"""


def default_model_path() -> str:
    """The shipped atlas-tiny checkpoint directory."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", DEFAULT_MODEL)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"the default model is missing from the package ({path}); reinstall atlas_jax "
                                "or pass a model directory")
    return path


def train_byte_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts` (special tokens first: ids 0, 1, ..)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _init_tensor(name: str, shape, rng) -> np.ndarray:
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith(("dt_bias", "linear_attn.norm.weight", "mixer.norm.weight", "mixer.D")):
        return np.ones(shape, np.float32)
    if name.endswith("e_score_correction_bias"):
        return np.zeros(shape, np.float32)
    if "norm" in name and name.startswith("backbone."):  # Nemotron-H: plain RMSNorm, scale = w
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    if "norm" in name:                                   # zero-centred: scale = 1 + w
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)
    std = 0.2 if "conv1d" in name else (0.5 if "embed" in name else 0.08)
    return (std * rng.standard_normal(shape)).astype(np.float32)


def write_random_checkpoint(path: str, config: dict, seed: int = _SEED) -> None:
    """Write an HF-format checkpoint (config.json + model.safetensors, with `num_nextn_predict_layers`
    MTP layers) of deterministic random weights for `config` (a config.json dict)."""
    from safetensors.numpy import save_file

    from .config import ModelConfig
    from .models import family

    cfg = ModelConfig.from_dict(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for spec in family(cfg.model_type).param_specs(cfg, mtp_layers=config.get("num_nextn_predict_layers", 0)):
        for name in spec.hf_names:
            tensors[name] = _init_tensor(name, spec.hf_shape, rng)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_tiny_random_model(path: str) -> None:
    tok = train_byte_bpe([_CORPUS], 512, ["<|endoftext|>"])
    eos = tok.token_to_id("<|endoftext|>")
    config = {**TINY_RANDOM_CONFIG, "vocab_size": 512, "eos_token_id": eos, "bos_token_id": None, "pad_token_id": None}
    write_random_checkpoint(path, config)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f, indent=2)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "model_max_length": config["max_position_embeddings"]}, f, indent=2)
