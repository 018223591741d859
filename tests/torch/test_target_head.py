"""The trainer's target head (final norm, lm_head, embeddings) is loaded alone, never the whole model:
a target only vLLM can hold must not be loaded again by the trainer."""
import subprocess
import sys

from tests.helpers.fixtures_train import REMOTE


def peak_rss_growth(load: str, touch: str) -> int:
    """Bytes by which a fresh process's peak RSS grows (after its imports) while it evaluates `load` into
    `loaded` and then runs `touch`."""
    probe = f"""
import sys, torch
sys.path.insert(0, {str(REMOTE)!r})
from states_from_shards import TargetHead
from transformers import AutoConfig, AutoModelForCausalLM
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS:")
loaded = {load}
{touch}
print(status("VmHWM:") - before)
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])


def test_trainer_loads_the_head_alone_not_the_model(tmp_path):
    """Peak memory of loading norm + lm_head + embeddings stays far below the model's weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=8192, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "big")
    path = str(tmp_path / "big")
    weights = (tmp_path / "big" / "model.safetensors").stat().st_size
    head_bytes = (2 * 512 * 256 + 256) * 4
    # Each probe touches every tensor it holds (safetensors are memory-mapped: untouched pages cost nothing).
    head = peak_rss_growth(f"TargetHead({path!r}, AutoConfig.from_pretrained({path!r}), torch.device('cpu'), "
                           f"torch.float32)", "[float(t.sum()) for t in (loaded.norm, loaded.lm_head, loaded.embed)]")
    full = peak_rss_growth(f"AutoModelForCausalLM.from_pretrained({path!r})",  # the probe does see a full load
                           "[float(p.sum()) for p in loaded.parameters()]")
    print(f"weights {weights / 1e6:.0f} MB, head {head_bytes / 1e6:.1f} MB; peak RSS grew {head / 1e6:.1f} MB "
          f"loading the head, {full / 1e6:.0f} MB loading the model")
    assert weights > 200e6 and full > 0.8 * weights
    assert head < head_bytes + 20e6
