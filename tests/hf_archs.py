"""Tiny Hugging Face causal LMs of the architectures `offload train --model DIR` and `offload estimate --model
DIR` are tested on (docs/training.md lists them): hidden 64, 2 layers, vocabulary 256, built from
transformers' config classes and written with save_pretrained (sharded, so the index is read too)."""

import torch

VOCAB = 256
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
_TOKENS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)

# model_type -> (config class, its arguments); tied: the output head is the input embedding
ARCHS = {
    "llama": ("LlamaConfig", dict(_DECODER)),
    "mistral": ("MistralConfig", dict(_DECODER, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(_DECODER)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_DECODER, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         num_experts=4, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", dict(_DECODER, num_local_experts=4, num_experts_per_tok=2)),
    "gemma": ("GemmaConfig", dict(_DECODER, head_dim=16)),                     # tied, scaled embedding
    "phi3": ("Phi3Config", dict(_DECODER, pad_token_id=0)),                     # fused qkv_proj, gate_up_proj
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),  # tied, Conv1D linears
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=64)),  # embed_out on disk
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                              word_embed_proj_dim=64, max_position_embeddings=64)),  # tied
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),  # tied
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4)),        # tied, ALiBi
}


def config(model_type: str):
    import transformers

    name, kwargs = ARCHS[model_type]
    return getattr(transformers, name)(**kwargs, **_TOKENS)


def save_model(model_type: str, path, seed: int = 0) -> None:
    """The model transformers builds from the tiny config with `seed`, written as save_pretrained writes it."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(model_type))
    model.save_pretrained(path, max_shard_size="100KB")
