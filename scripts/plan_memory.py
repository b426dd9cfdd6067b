"""Per-device memory of serving a model sharded over T devices, from its config alone (no weights, no devices):
weights, one KV page, one sequence's recurrent state, one prefix snapshot, an activation estimate, and how many
sequences of a given length fit per device. Prints one JSON object.

    python scripts/plan_memory.py CONFIG [--tp T] [--dp D] [--ep] [--dtype bfloat16] [--seq-len 32768] [--device-gib 141]

With --dp D (data-parallel attention) the weights are those of the D x T mesh (experts over all of it with --ep)
and the sequences per device are one rank's; the engine holds D times as many.

CONFIG: a checkpoint directory or its config.json (the file alone is enough: a few KB from the model's page),
or a preset: qwen3-next-80b-a3b, qwen3.5-35b-a3b (the released configs' shapes). Same sharding rules as the
engine (atlas_jax/parallel/sharding.py via parallel/memory_plan.py); tests/engine/test_tensor_parallel.py checks
the numbers against real sharded engines on virtual devices.
"""
import argparse
import json
import os

import jax.numpy as jnp

from atlas_jax.config import ModelConfig
from atlas_jax.parallel.memory_plan import plan

_QWEN3_NEXT_80B = {
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "decoder_sparse_step": 1, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}
PRESETS = {  # (config, MTP layers)
    "qwen3-next-80b-a3b": (_QWEN3_NEXT_80B, 1),
    "qwen3.5-35b-a3b": ({**_QWEN3_NEXT_80B, "model_type": "qwen3_5_moe_text", "vocab_size": 248320,
                         "num_hidden_layers": 40, "num_experts": 256, "num_experts_per_tok": 8}, 1),
}


def load(config: str) -> tuple[ModelConfig, int]:
    if config in PRESETS:
        raw, mtp = PRESETS[config]
        return ModelConfig.from_dict(raw), mtp
    path = os.path.join(config, "config.json") if os.path.isdir(config) else config
    with open(path) as f:
        raw = json.load(f)
    text = raw.get("text_config", raw)
    return ModelConfig.from_dict(raw), int(text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1, help="data_parallel_size (ranks with their own batches)")
    ap.add_argument("--ep", action="store_true", help="expert parallel (whole experts per device)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--device-gib", type=float, default=141.0, help="memory per device (H200: 141, H100: 80)")
    ap.add_argument("--fraction", type=float, default=0.9, help="of the device memory the engine may take")
    ap.add_argument("--num-drafts", type=int, default=0, help="MTP drafts per step (deeper recurrent slots, head KV)")
    ap.add_argument("--tokens", type=int, default=8192, help="a step's token budget (activation estimate)")
    args = ap.parse_args()
    cfg, mtp_layers = load(args.config)
    p = plan(cfg, jnp.dtype(args.dtype), args.tp, args.ep, mtp_layers, args.page_size, args.num_drafts, args.tokens,
             dp=args.dp)
    gib = lambda b: round(b / 2**30, 3)
    print(json.dumps({
        "config": args.config, "model_type": cfg.model_type, "tp": args.tp, "dp": args.dp, "expert_parallel": args.ep,
        "dtype": args.dtype, "weights_gib": gib(p.weights), "weights_share": round(p.weights / p.total_weights, 4),
        "kv_page_bytes": p.kv_page, "kv_bytes_per_token": p.kv_page // args.page_size,
        "sequence_state_mib": round(p.sequence_state / 2**20, 2), "snapshot_mib": round(p.snapshot / 2**20, 2),
        "activations_gib_estimate": gib(p.activations), "seq_len": args.seq_len,
        "sequences_per_device": p.sequences(int(args.device_gib * 2**30), args.seq_len, args.page_size,
                                            args.fraction)}))


if __name__ == "__main__":
    main()
