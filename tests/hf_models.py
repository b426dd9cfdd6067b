"""Tiny random HF checkpoints, made with transformers' own save_pretrained (the oracle)."""
from __future__ import annotations

import torch


def _randomise_norms(model, seed: int):
    """HF initialises norm weights to constants; randomise them so a wrong norm convention fails."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g) + (0.0 if "next" in type(model).__name__.lower() else 1.0))


def _slow_decay(model, seed: int):
    """HF initialises A_log to log U(0, 16): a GDN state then decays by ~e^-10 per token and carries
    almost nothing across tokens, so a broken state carry would go unnoticed. Trained models decay
    slowly; make the tiny ones do so too (A in [0.005, 0.1])."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(0.005 + 0.095 * torch.rand(p.shape, generator=g)))


def make_qwen3(path, *, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, tie=False,
               attention_bias=False, seed=0, init_std=0.02):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      tie_word_embeddings=tie, attention_bias=attention_bias, max_position_embeddings=512,
                      initializer_range=init_std)
    model = Qwen3ForCausalLM(cfg).eval()
    _randomise_norms(model, seed)
    model.save_pretrained(path)
    return model


def make_qwen3_moe(path, *, hidden=64, layers=2, heads=4, kv_heads=1, head_dim=24, vocab=128, experts=8, top_k=2,
                   seed=0, mlp_only_layers=(), norm_topk_prob=True):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32,
                         mlp_only_layers=list(mlp_only_layers), norm_topk_prob=norm_topk_prob,
                         max_position_embeddings=512)
    model = Qwen3MoeForCausalLM(cfg).eval()
    _randomise_norms(model, seed)
    model.save_pretrained(path)
    return model


def make_qwen3_next(path, *, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32, vocab=128, experts=8, top_k=2,
                    k_heads=2, v_heads=4, dk=16, dv=24, tie=False, seed=0, interval=4, init_std=0.02):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                          linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=dk,
                          linear_value_head_dim=dv, num_experts=experts, num_experts_per_tok=top_k,
                          moe_intermediate_size=32, shared_expert_intermediate_size=48, tie_word_embeddings=tie,
                          full_attention_interval=interval, max_position_embeddings=512, initializer_range=init_std)
    model = Qwen3NextForCausalLM(cfg).eval()
    _randomise_norms(model, seed)
    _slow_decay(model, seed)
    model.save_pretrained(path)
    return model
