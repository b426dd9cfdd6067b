"""Tiny random HF checkpoints, made with transformers' own save_pretrained (the oracle)."""
from __future__ import annotations

import torch


def hf_greedy(hf, prompt, n: int) -> list[int]:
    """HF's greedy continuation of `prompt` (n tokens, EOS ignored): the oracle for generation tests."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


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


def make_qwen3_5(path, *, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32, vocab=128, k_heads=2, v_heads=4,
                 dk=16, dv=24, tie=False, seed=0, interval=4, init_std=0.02, moe=False, experts=8, top_k=2,
                 vision=False, fused_experts=False, shard_size=None):
    """Qwen3.5 (dense) or Qwen3.5-MoE, as ForCausalLM or wrapped in ForConditionalGeneration with a
    (tiny) vision tower, as released checkpoints are (decoder under model.language_model.). Real
    configs' multimodal RoPE fields are set. fused_experts: the MoE experts written as the two 3-D
    tensors per layer that released Qwen3.5-MoE checkpoints hold (transformers' own parameter layout)
    instead of save_pretrained's one tensor per expert. shard_size: sharded safetensors + index."""
    import transformers as tr
    from safetensors.torch import save_file
    torch.manual_seed(seed)
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=dk,
                linear_value_head_dim=dv, max_position_embeddings=512, initializer_range=init_std,
                tie_word_embeddings=tie, eos_token_id=vocab - 1,
                layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    if moe:
        text.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)
    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    if vision:
        vis = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden)
        cfg = getattr(tr, f"{family}Config")(text_config=text, vision_config=vis, tie_word_embeddings=tie)
        model = getattr(tr, f"{family}ForConditionalGeneration")(cfg).eval()
    else:
        model = getattr(tr, f"{family}ForCausalLM")(getattr(tr, f"{family}TextConfig")(**text)).eval()
    _randomise_norms_zero_centred(model, seed)
    _slow_decay(model, seed)
    model.save_pretrained(path, **({"max_shard_size": shard_size} if shard_size else {}))
    if fused_experts:
        assert not shard_size
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if tie:
            state.pop("lm_head.weight", None)
        assert any(k.endswith("experts.gate_up_proj") for k in state)
        save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    return model


def _randomise_norms_zero_centred(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" not in name and (name.endswith("norm.weight") or name.endswith("layernorm.weight")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def make_nemotron_h(path, *, hidden=64, blocks="M-*E-M", heads=4, kv_heads=2, head_dim=16, vocab=128,
                    mamba_heads=8, mamba_head_dim=16, state=16, groups=2, chunk=16, experts=8, top_k=2, n_group=2,
                    topk_group=1, latent=None, tie=False, seed=0, init_std=0.02, fused_experts=False):
    """Nemotron-H from its pattern string (M mamba, * attention, - mlp, E moe), saved by save_pretrained
    (backbone.* names, one tensor per expert) or, fused_experts, with transformers' 3-D expert tensors.
    tie only sets the config flag: transformers' NemotronH never ties (lm_head.weight is its own)."""
    from safetensors.torch import save_file
    from transformers import NemotronHConfig, NemotronHForCausalLM
    torch.manual_seed(seed)
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    cfg = NemotronHConfig(vocab_size=vocab, hidden_size=hidden, layers_block_type=[kinds[c] for c in blocks],
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                          intermediate_size=96, mamba_num_heads=mamba_heads, mamba_head_dim=mamba_head_dim,
                          ssm_state_size=state, n_groups=groups, conv_kernel=4, chunk_size=chunk,
                          n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32,
                          moe_shared_expert_intermediate_size=48, n_group=n_group, topk_group=topk_group,
                          routed_scaling_factor=2.5, moe_latent_size=latent, max_position_embeddings=512,
                          tie_word_embeddings=tie, initializer_range=init_std, eos_token_id=vocab - 1)
    model = NemotronHForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):            # slow decay (see _slow_decay), per head
                p.copy_(torch.log(0.05 + 0.5 * torch.rand(p.shape, generator=g)))
            elif name.endswith(".D") or name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # HF initialises it to zero: make it matter
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path)
    if fused_experts:
        state = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
                 for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.up_proj") for k in state)
        save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    return model
