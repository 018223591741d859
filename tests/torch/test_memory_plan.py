"""The memory plan (remote/train_plan.py) against the real thing, without a host: Kimi-K2 on 8×H200 and
8×H100 through train.py --plan, a batch too big, and the plan's activation bytes per token against a real
step's peak memory on this CPU."""
import json
import sys

from tests.helpers.fixtures_train import ROOT, run_script


KIMI_CONFIG = ROOT / "bench" / "kimi-k2" / "config.json"


def plan(target, *args):
    r = run_script("train.py", "--plan", "--target", target, *args, check=False)
    assert "Traceback" not in r.stderr, r.stderr
    return r, (json.loads(r.stdout.splitlines()[0]) if r.stdout.startswith("{") else None)


def test_plan_of_kimi_k2_fits_8_h200_and_8_h100_and_is_refused_on_24_gb(tmp_path):
    """From config.json alone (the directory holds nothing else): fits on 8xH200 and 8xH100 with a batch of
    at least 16k tokens per GPU, refused on a 24 GB GPU in one line naming what to change; the online path
    (the whole 1T-parameter target on every GPU) is refused pointing at --states."""
    target = tmp_path / "kimi"
    target.mkdir()
    (target / "config.json").write_text(KIMI_CONFIG.read_text())
    for gpu_gb in (141, 80):
        r, p = plan(target, "--states", "x", "--gpu-gb", gpu_gb, "--gpus", 8)
        assert r.returncode == 0 and p["fits"] and p["batch_tokens"] >= 16384, r.stdout
        assert p["peak_gb"] <= gpu_gb and p["tokens_per_s"] > 0 and p["assumed_tflops_per_gpu"] > 0
        assert 0.8e9 < p["trainable_params"] < 1.2e9  # the public Kimi drafts' size, not the target layer's copy
        assert "activations per token" in r.stdout and "fits" in r.stdout.splitlines()[-1]
    small, p = plan(target, "--states", "x", "--gpu-gb", 24, "--gpus", 1)
    assert small.returncode == 2 and not p["fits"] and "--draft-intermediate" in p["reason"]
    online, p = plan(target, "--gpu-gb", 141, "--gpus", 8)
    assert online.returncode == 2 and "--states" in p["reason"]
    # a real run is refused the same way, before it reads anything but config.json (no tokenizer here)
    run = run_script("train.py", "--target", target, "--data", tmp_path / "none.jsonl", "--out", tmp_path / "out",
                     check=False)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--states" in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()


def test_a_batch_too_big_is_refused_naming_the_largest_that_fits_not_the_sample_length():
    """Host-free: with a --max-len that is no multiple of 256, the largest batch is not rounded below the
    one sample that fits, so a too-big --batch-tokens is told the largest, not that one sample is too long."""
    sys.path.insert(0, str(ROOT / "remote"))
    import train_plan

    config = json.loads(KIMI_CONFIG.read_text())
    shape = train_plan.draft_shape(config, 32000)
    common = dict(shape=shape, gpus=8, ttt=7, online=False, gpu_gb=141)
    lo, hi = 4096, 2**22  # the most tokens a step can hold here (a batch of max_len 4096 samples)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if train_plan.plan(config, batch_tokens=mid, max_len=4096, **common)["fits"] else (lo, mid)
    max_len = lo if lo % 256 else lo - 1  # one sample of exactly what fits
    auto = train_plan.plan(config, batch_tokens="auto", max_len=max_len, **common)
    assert auto["fits"] and auto["largest_batch_tokens"] >= max_len
    big = train_plan.plan(config, batch_tokens=max_len + 256, max_len=max_len, **common)
    assert not big["fits"] and big["reason"].startswith(f"--batch-tokens {max_len + 256} does not fit"), big["reason"]


def test_plans_activation_bytes_per_token_agree_with_a_cpu_measurement():
    """Peak memory of one real step at T and 2T tokens, at a reduced width (Kimi's draft / 32, 3 TTT steps: not
    the shapes the plan's constant was measured at), against the plan's bytes per token: within 25 %, for the
    step a GPU runs (each TTT step recomputed in backward) and the one a CPU host runs (none recomputed)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import train_memory

    shape = train_memory.scaled(32)
    for impl, recompute in (("after", True), ("cpu", False)):
        measured = train_memory.measured_bytes_per_token(shape, 1024, 3, impl)
        planned = train_memory.planned_bytes_per_token(shape, 1024, 3, recompute=recompute)
        assert abs(planned - measured) <= 0.25 * measured, (impl, planned, measured)


def test_draft_heads_are_as_wide_as_the_targets_whatever_their_count_or_config_class():
    """Host-free: --draft-heads changes the count, not the width (hidden_size // heads can be a head size
    serving refuses); an MLA target's config object may carry head_dim = its rope part (transformers'
    DeepseekV3Config writes 64), which must not shrink the draft the plan sized from config.json."""
    sys.path.insert(0, str(ROOT / "remote"))
    import train_plan

    kimi = json.loads(KIMI_CONFIG.read_text())
    assert "head_dim" not in kimi and train_plan.draft_shape(kimi, 32000).head_dim == 7168 // 64
    assert train_plan.draft_shape({**kimi, "head_dim": 64}, 32000).head_dim == 112
    smaller = train_plan.draft_shape(kimi, 32000, heads=32, kv_heads=8)
    assert (smaller.heads, smaller.kv_heads, smaller.head_dim) == (32, 8, 112)
    gqa = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "intermediate_size": 256, "vocab_size": 512}
    assert [train_plan.draft_shape(gqa, 256, heads=h).head_dim for h in (2, 4, 8)] == [32, 32, 32]
