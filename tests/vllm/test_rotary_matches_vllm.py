"""The rotary embedding the draft trains with is the one vLLM serves it with.

For each `rope_scaling` a supported target can carry, the draft's config is built from a target config
as training builds it (draft_model.DraftConfig.from_target), exported as training exports it, and read
back by the installed vLLM's own config loader; its `get_rope` must give the trainer's cos/sin at every
position 0..8192, to rounding. An upgrade of vLLM or transformers that changes either side fails here,
not as a draft that loads fine and accepts little.
"""
import json
import sys

import pytest
import torch

from tests.helpers.fixtures_train import REMOTE

sys.path.insert(0, str(REMOTE))
from draft_model import DraftConfig, export_config  # noqa: E402

POSITIONS = 8193
LLAMA = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=1000, max_position_embeddings=131072)
# Kimi-K2's block, as its public config.json writes it (the legacy `type` key)
KIMI = json.loads((REMOTE.parent / "bench" / "kimi-k2" / "config.json").read_text())
ROPES = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32,
                    "beta_slow": 1, "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.9,
                              "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
}


def _target(name):
    from transformers import DeepseekV3Config, LlamaConfig
    if name == "kimi":
        return DeepseekV3Config(**{**LLAMA, "rope_scaling": KIMI["rope_scaling"]}, moe_intermediate_size=256,
                                q_lora_rank=96, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                v_head_dim=32, n_routed_experts=4, rope_theta=KIMI["rope_theta"])
    rope = ROPES[name]
    return LlamaConfig(**LLAMA, **({"rope_parameters": rope} if rope else {}))


def _trainer_cos_sin(config: DraftConfig):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cos, sin = LlamaRotaryEmbedding(config.llama_config())(torch.zeros(1), torch.arange(POSITIONS)[None])
    half = cos.shape[-1] // 2  # neox layout: each frequency twice
    return cos[0, :, :half], sin[0, :, :half]


def _served_cos_sin(draft_dir, head_dim: int):
    """What vLLM computes for the exported draft: its config loader, then get_rope as its Llama layer calls it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config

    served = get_config(str(draft_dir), trust_remote_code=False)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(head_dim, max_position=served.max_position_embeddings,
                        rope_parameters=getattr(served, "rope_parameters", None), is_neox_style=True,
                        dtype=torch.float32)
    cache = rope.cos_sin_cache[:POSITIONS].float()
    half = cache.shape[-1] // 2
    return cache[:, :half], cache[:, half:]


def _export(tmp_path, config: DraftConfig):
    (tmp_path / "config.json").write_text(json.dumps(export_config(config, torch.float32)))
    return tmp_path


@pytest.mark.parametrize("name", [*ROPES, "kimi"])
def test_the_draft_trains_with_the_rotary_vllm_serves(name, tmp_path):
    draft = DraftConfig.from_target(_target(name), 64, [0, 1, 2])
    cos, sin = _trainer_cos_sin(draft)
    served_cos, served_sin = _served_cos_sin(_export(tmp_path, draft), draft.head_dim)
    torch.testing.assert_close(served_cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(served_sin, sin, rtol=0, atol=1e-6)


def test_the_comparison_sees_a_mismatch(tmp_path):
    """The check itself: a draft exported with another factor than it trained with is caught."""
    trained = DraftConfig.from_target(_target("linear"), 64, [0, 1, 2])
    exported = DraftConfig.from_target(_target("linear"), 64, [0, 1, 2])
    exported.rope_parameters = {**exported.rope_parameters, "factor": 2.0}
    cos, _ = _trainer_cos_sin(trained)
    served_cos, _ = _served_cos_sin(_export(tmp_path, exported), trained.head_dim)
    assert (served_cos - cos).abs().max() > 0.1


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
     "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
])
def test_a_scaling_the_pair_cannot_reproduce_is_refused_naming_it(rope):
    """Dynamic NTK and longrope are computed differently by the two sides past some length: refused up front."""
    from script import Refused
    from transformers import LlamaConfig
    with pytest.raises(Refused, match=f"RoPE scaling '{rope['rope_type']}' is not one the draft can train"):
        DraftConfig.from_target(LlamaConfig(**LLAMA, rope_parameters=rope), 64, [0, 1, 2])


def test_the_plan_refuses_it_before_anything_loads(tmp_path):
    """`train.py --plan` (and a run's own plan) reads config.json alone: the refusal comes there, in one line."""
    import subprocess
    kimi = dict(KIMI, rope_scaling={"type": "dynamic", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(kimi))
    plan = [sys.executable, str(REMOTE / "train.py"), "--plan", "--target", str(tmp_path), "--gpu-gb", "80"]
    refused = subprocess.run(plan, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "train.py: the target's RoPE scaling 'dynamic' is not one the draft can train as vLLM serves it (supported: "
        "default, linear, llama3, yarn); its draft would load and accept little"], refused.stderr
    (tmp_path / "config.json").write_text(json.dumps(KIMI))
    planned = subprocess.run([*plan, "--states", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0 and "RoPE" not in planned.stderr, planned.stderr  # Kimi's own YaRN plans
