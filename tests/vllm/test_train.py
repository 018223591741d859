"""remote/train.py and its parts, on the tiny target: rendering, target states, training, export, resume, DDP.

Real parts only: the tiny model built by the project, a real vLLM for what the model emits,
training as a subprocess. No speed is asserted (2 shared cores).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.fixtures_train import LAYER_NAMES, REMOTE, chat_rows, metrics, run_script, train, train_args

sys.path.insert(0, str(REMOTE))
from chat_render import ChatRenderer, normalise  # noqa: E402
from target_states import CachedTargetStates, OnlineTargetStates  # noqa: E402


@pytest.fixture(scope="module")
def renderer(tiny_model):
    return ChatRenderer.from_pretrained(str(tiny_model))


def decode_masked(renderer, sample):
    return renderer.tok.decode([t for t, m in zip(sample.ids, sample.mask) if m])


# ---------------------------------------------------------------- rendering


def test_render_is_the_templates_own_text_with_loss_on_the_answer(renderer):
    """Reasoning in the form the template writes it: the sample is the template's own rendering."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "\n\n2 + 3 = 5.", "reasoning": "\nAdd the ones: 2 + 3 = 5.\n"}]
    template_chat = chat[:2] + [{"role": "assistant", "content": "2 + 3 = 5.", "reasoning": "Add the ones: 2 + 3 = 5."}]
    [sample] = renderer.render(chat, max_len=4096)
    full = renderer.tok.apply_chat_template(template_chat, tokenize=False)
    prompt = renderer.tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)
    assert full.endswith("<|im_end|>\n")
    assert renderer.tok.decode(sample.ids) == full[:-1]  # the model stops at <|im_end|>; the "\n" is the template's
    assert decode_masked(renderer, sample) == full[len(prompt):-1]
    assert sample.mask == sorted(sample.mask)  # prompt 0s, then answer 1s
    assert len(renderer.render(chat, max_len=10)[0].ids) == 10  # cut, never wrapped


def test_render_multi_turn_uses_the_history_the_client_sent(renderer):
    """Turn 2's context holds turn 1 as content only (what generate sends back): its own sample."""
    chat = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "\n\nA1", "reasoning": "\nR1\n"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "\n\nA2", "reasoning": "\nR2\n"}]
    first, second = renderer.render(chat, max_len=4096)
    assert renderer.tok.decode(second.ids) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n\n\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>")
    assert decode_masked(renderer, first) == "<think>\nR1\n</think>\n\nA1<|im_end|>"
    assert decode_masked(renderer, second) == "<think>\nR2\n</think>\n\nA2<|im_end|>"


def test_render_keeps_unclosed_thinking_and_truncation_as_emitted(renderer):
    chat = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": None, "reasoning": "\nhalf"}]
    [stopped] = renderer.render(chat, 4096)
    [cut] = renderer.render(chat, 4096, ended=[False])
    assert decode_masked(renderer, stopped) == "<think>\nhalf<|im_end|>"
    assert decode_masked(renderer, cut) == "<think>\nhalf"


def test_render_reproduces_the_tokens_the_model_emitted(renderer, vllm_server):
    """The chat API's reasoning + content, rendered, are exactly the token ids vLLM generated."""
    from openai import OpenAI

    client = OpenAI(base_url=vllm_server.base_url + "/v1", api_key="x")
    for question in ("What is 17 + 25?", "Reverse the word 'garden'.", "Is 48 even or odd?"):
        messages = [{"role": "user", "content": question}]
        chat = client.chat.completions.create(model=vllm_server.model, messages=messages, temperature=0, max_tokens=300)
        message = chat.choices[0].message
        assert chat.choices[0].finish_reason == "stop"
        record = {"messages": messages + [{"role": "assistant", "content": message.content,
                                           "reasoning": message.model_extra["reasoning"]}]}
        [sample] = renderer.render(normalise(record), max_len=4096)

        prompt = renderer.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        raw = client.completions.create(model=vllm_server.model, prompt=prompt, temperature=0, max_tokens=300,
                                        extra_body={"return_token_ids": True})
        prompt_ids, output_ids = raw.choices[0].model_extra["prompt_token_ids"], raw.choices[0].model_extra["token_ids"]
        assert sample.ids == prompt_ids + output_ids
        assert sample.mask == [0] * len(prompt_ids) + [1] * len(output_ids)


# ---------------------------------------------------------------- target states


def test_aux_states_are_the_inputs_of_layers_in_vllm_convention(tiny_model):
    """id k = the residual stream entering layer k (HF hidden_states[k]); id L = the last layer's
    output before the final norm (HF's hidden_states[L] is after it). Shifted ids would fail here."""
    target = OnlineTargetStates(str(tiny_model), None, torch.device("cpu"), torch.float32)
    L = target.config.num_hidden_layers
    assert L == 2 and target.aux_layer_ids == [0, 1, 2]  # the ids for the 2-layer target
    ids = torch.tensor([[1, 276, 201, 325, 264, 364, 294, 283, 18, 33, 2, 201, 1, 275, 201, 510]])
    states = target.states(ids, torch.ones_like(ids), [0])
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    hs, H = out.hidden_states, target.config.hidden_size
    blocks = states.aux.split(H, dim=-1)
    for k in range(L):
        torch.testing.assert_close(blocks[k], hs[k], rtol=0, atol=0)
        assert not torch.allclose(blocks[k], hs[k + 1], atol=1e-3)  # an off-by-one would match these
    torch.testing.assert_close(blocks[L], states.last, rtol=0, atol=0)
    assert not torch.allclose(blocks[L], hs[L], atol=1e-3)  # pre-norm, unlike HF's last entry
    torch.testing.assert_close(target.model.base_model.norm(blocks[L]), hs[L])
    torch.testing.assert_close(target.logits(states.last), out.logits)


def test_the_replay_carries_what_the_target_says_past_its_stop(tiny_model):
    """held_out.greedy_samples: the target's greedy answer up to its stop, then past_stop argmax tokens
    more (scored like the answer, marked as the tail), each what the target says after the ones before."""
    from held_out import greedy_samples  # noqa: E402

    target = OnlineTargetStates(str(tiny_model), None, torch.device("cpu"), torch.float32)
    renderer = ChatRenderer.from_pretrained(str(tiny_model))
    rows = [{"messages": [{"role": "user", "content": "What is 12 plus 7?"}]}]
    (plain,) = greedy_samples(target.model, renderer, rows, 1, 64, 512, torch.device("cpu"))
    (sample,) = greedy_samples(target.model, renderer, rows, 1, 64, 512, torch.device("cpu"), past_stop=2)
    n = len(plain.ids)
    assert plain.tail == 0 and int(plain.ids[-1]) in renderer.stop_ids()
    assert sample.tail == 2 and sample.ids[:n].tolist() == plain.ids.tolist() and len(sample.ids) == n + 2
    assert sample.mask[n:].all() and sample.mask.sum() == plain.mask.sum() + 2
    with torch.no_grad():
        logits = target.model(input_ids=sample.ids[None].long()).logits[0]
    assert sample.ids[n:].tolist() == logits[n - 1 : n + 1].argmax(-1).tolist()


def test_kept_states_are_what_the_target_says_of_each_sample_in_any_batch(tiny_model):
    """A CPU run keeps each sample's states from its first batch; later epochs group the samples
    differently (other widths, other neighbours), and what comes back must be the target's own there.
    A budget too small for a sample keeps nothing of it, and the target runs again."""
    online = OnlineTargetStates(str(tiny_model), None, torch.device("cpu"), torch.float32)
    rows = [[1, 276, 201, 325, 264, 364, 294, 283, 18, 33, 2], [1, 275, 201, 510, 18], [1, 33, 2, 201, 1, 275, 201]]

    def batch(index):
        width = max(len(rows[i]) for i in index)
        ids = torch.tensor([rows[i] + [0] * (width - len(rows[i])) for i in index])
        return ids, torch.tensor([[1] * len(rows[i]) + [0] * (width - len(rows[i])) for i in index])

    def real(states, attention):
        return [(states.aux[r, : n], states.last[r, : n]) for r, n in enumerate(attention.sum(1).tolist())]

    H = online.config.hidden_size
    kept = CachedTargetStates(online, budget_bytes=(len(rows[0]) + len(rows[1])) * 4 * H * 4)
    kept.states(*batch([0, 1, 2]), [0, 1, 2])
    assert sorted(kept.kept) == [0, 1]  # the third did not fit
    for index in ([1, 0], [0]):
        ids, attention = batch(index)
        for got, want in zip(real(kept.states(ids, attention, index), attention), real(online.states(ids, attention, index), attention)):
            torch.testing.assert_close(got, want)
    ids, attention = batch([2, 1])  # one sample not kept: the target runs, and says what it says
    for got, want in zip(real(kept.states(ids, attention, [2, 1]), attention), real(online.states(ids, attention, [2, 1]), attention)):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- training and export


def test_training_loss_falls_and_first_position_accuracy_rises(trained_run):
    rows = metrics(trained_run)
    assert len(rows) == 300 and [r["step"] for r in rows] == list(range(1, 301))
    head, tail = rows[:10], rows[-10:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(tail, "loss") < 0.5 * mean(head, "loss")
    assert mean(tail, "acc_0") > mean(head, "acc_0") + 0.3
    assert {"acc_0", "acc_1", "acc_2", "sim_al", "tokens_per_s", "lr"} <= set(rows[-1])


def test_the_held_out_prediction_is_within_0_1_of_what_vllm_measures(trained_run):
    """The trainer's predicted acceptance length (the target's greedy continuations of the held-out rows'
    prompts, walked as vLLM drafts them) against vLLM's own counters on the same prompts."""
    (last,) = [json.loads(line) for line in (trained_run / "evals.jsonl").read_text().splitlines()]
    assert last["step"] == 300 and last["kept"] and (trained_run / "heldout.jsonl").is_file()
    assert last["measured_al"] > 2.5, last  # a trained draft: a random one of its shape measures ~1.0
    assert abs(last["val_sim_al"] - last["measured_al"]) <= 0.1, last


def test_held_out_hits_are_split_by_how_sure_the_target_is(trained_run):
    """The split covers exactly the first-position accuracy's tokens, and a trained draft misses mostly where
    the target itself hesitates (acceptance.hits_by_certainty)."""
    (last,) = [json.loads(line) for line in (trained_run / "evals.jsonl").read_text().splitlines()]
    sure, unsure, share = last["val_acc_0_sure"], last["val_acc_0_unsure"], last["val_sure_share"]
    assert 0.2 < share < 1.0, last
    assert abs(sure * share + unsure * (1 - share) - last["val_acc_0"]) < 1e-3, last
    assert sure > unsure + 0.1, last


def test_runs_that_differ_in_seed_are_measured_on_the_same_held_out_rows(tiny_model, generated_data, trained_run,
                                                                        tmp_path):
    """--seed changes the draft's start and the data order, not the held-out rows (--split-seed picks those):
    otherwise two seeds' acceptance lengths compare two different sets of prompts."""
    def two_steps(*flags):  # fp32 as trained_run, whose first loss the other seed's must differ from
        return train(tiny_model, generated_data, tmp_path / "-".join(flags), "--steps", "2", "--dtype", "fp32", *flags)

    other_seed, other_split = two_steps("--seed", "1"), two_steps("--split-seed", "1")
    rows = (trained_run / "heldout.jsonl").read_text()
    assert rows and (other_seed / "heldout.jsonl").read_text() == rows
    assert (other_split / "heldout.jsonl").read_text() != rows
    assert metrics(other_seed)[0]["loss"] != metrics(trained_run)[0]["loss"]  # the seed still reaches training


def test_a_time_budget_ends_the_run_and_its_schedule_on_the_clock(tiny_model, generated_data, tmp_path):
    """--time-budget: the steps stop at the first one past the budget, long before --steps, with the cosine
    run to its end (lr 0), the held-out rows scored and the draft exported there; a resume adds nothing."""
    args = ["--steps", "100000", "--time-budget", "4", "--warmup", "0.3", "--dtype", "fp32"]  # warmup: ~1.2 s
    out = train(tiny_model, generated_data, tmp_path / "budget", *args)
    rows = metrics(out)
    assert 5 < len(rows) < 100000 and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[-1]["train_s"] >= 4 > rows[-2]["train_s"]
    lrs = [r["lr"] for r in rows]
    peak = lrs.index(max(lrs))
    assert lrs[0] < lrs[peak] and lrs[-1] == 0.0  # warmup, then the cosine down to zero at the budget
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1 :]))
    (scored,) = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    assert scored["step"] == len(rows) and (out / "draft" / "model.safetensors").is_file()
    assert f"| steps | {len(rows)} " in (out / "draft" / "README.md").read_text()

    run_script("train.py", *train_args(tiny_model, generated_data, out, *args), "--resume")
    assert len(metrics(out)) == len(rows)


def test_export_is_exactly_what_vllm_loads(trained_run, tiny_model):
    draft = trained_run / "draft"
    tensors = load_file(draft / "model.safetensors")
    assert set(tensors) == LAYER_NAMES  # full vocab: no d2t/t2d (vLLM rejects d2t then)
    config = json.loads((draft / "config.json").read_text())
    target = json.loads((tiny_model / "config.json").read_text())
    H, V = target["hidden_size"], target["vocab_size"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["max_position_embeddings"] == target["max_position_embeddings"]
    assert (config["vocab_size"], config["draft_vocab_size"], config["num_hidden_layers"]) == (V, V, 1)
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (target["num_attention_heads"] * target["head_dim"], 2 * H)
    assert tensors["lm_head.weight"].shape == (V, H)
    card = (draft / "README.md").read_text()
    assert str(tiny_model) in card and "| steps | 300 " in card and "simulated acceptance length" in card


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_ends_with_the_same_weights_as_an_uninterrupted_run(tiny_model, generated_data, tmp_path, optimizer):
    args = ["--steps", "60", "--save-every", "5", "--batch-tokens", "512", "--optimizer", optimizer]
    whole = train(tiny_model, generated_data, tmp_path / "whole", *args)

    cut = tmp_path / "cut"
    cut_args = train_args(tiny_model, generated_data, cut, *args)
    proc = subprocess.Popen([sys.executable, str(REMOTE / "train.py"), *cut_args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if (cut / "metrics.jsonl").exists() and len((cut / "metrics.jsonl").read_text().splitlines()) >= 12:
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    interrupted_at = torch.load(cut / "checkpoint.pt", weights_only=False)["step"]
    assert 10 <= interrupted_at < 60, "the run must be killed mid-way for this test to mean anything"
    assert not (cut / "draft").exists()

    run_script("train.py", *cut_args, "--resume")
    a, b = load_file(whole / "draft" / "model.safetensors"), load_file(cut / "draft" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in metrics(whole)] == [r["loss"] for r in metrics(cut)]
    seconds = [r["train_s"] for r in metrics(cut)]  # the steps' own seconds carry on past the resume
    assert all(b > a for a, b in zip(seconds, seconds[1:])), seconds


def test_torchrun_two_cpu_processes_train_and_export(tiny_model, generated_data, trained_run, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REMOTE / "train.py"), "--target", str(tiny_model), "--data", str(generated_data), "--out", str(out),
           "--steps", "8", "--batch-tokens", "1024", "--ttt-steps", "3", "--lr", "1e-2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert max(r["tokens"] for r in rows) > 1024  # both ranks' batches counted: one rank holds <= 1024
    assert result.stdout.count('"stage":"done"') == 1  # one rank reports
    ddp = load_file(out / "draft" / "model.safetensors")
    single = load_file(trained_run / "draft" / "model.safetensors")
    assert {k: v.shape for k, v in ddp.items()} == {k: v.shape for k, v in single.items()}
    assert json.loads((out / "draft" / "config.json").read_text()) == json.loads(
        (trained_run / "draft" / "config.json").read_text())


def test_bad_input_is_one_line_and_exit_2(tiny_model, generated_data, trained_run, tmp_path):
    missing = run_script("train.py", "--target", tiny_model, "--data", tmp_path / "nope.jsonl", "--out", tmp_path / "o",
                         check=False)
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "nope.jsonl" in missing.stderr and "Traceback" not in missing.stderr
    again = run_script("train.py", "--target", tiny_model, "--data", trained_run / "metrics.jsonl", "--out", trained_run,
                       check=False)
    assert again.returncode == 2 and "--resume" in again.stderr
    too_deep = run_script("train.py", "--target", tiny_model, "--data", generated_data, "--out", tmp_path / "o2",
                          "--aux-layers", "0,1,3", check=False)
    assert too_deep.returncode == 2 and "aux layer ids [0, 1, 3]" in too_deep.stderr
    assert "Traceback" not in too_deep.stderr


# ---------------------------------------------------------------- distributed

PROBE = """
import atexit, json, os, runpy, sys
import torch, torch.distributed as dist

seen = {"groups": [], "collectives": [], "model_devices": []}
_cpu = torch.Tensor.cpu


def cpu(self, *a, **k):  # on a CPU machine .cpu() is the tensor itself: mark it, a collective then sees the mark
    out = _cpu(self, *a, **k)
    out._moved_to_cpu = True
    return out


def watch(name, fn):
    def wrapped(tensor, *a, **k):
        seen["collectives"].append({"op": name, "device": str(tensor.device),
                                    "moved_to_cpu": bool(getattr(tensor, "_moved_to_cpu", False))})
        return fn(tensor, *a, **k)
    return wrapped


_init = dist.init_process_group


def init(backend=None, *a, **k):
    seen["groups"].append(backend)
    return _init(backend, *a, **k)


_ddp = torch.nn.parallel.DistributedDataParallel.__init__


def ddp(self, module, *a, **k):
    seen["model_devices"].append(str(next(module.parameters()).device))
    return _ddp(self, module, *a, **k)


torch.Tensor.cpu = cpu
dist.init_process_group = init
for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"):
    setattr(dist, name, watch(name, getattr(dist, name)))
torch.nn.parallel.DistributedDataParallel.__init__ = ddp
atexit.register(lambda: open(os.environ["PROBE_OUT"], "w").write(json.dumps(seen)))
sys.argv = [sys.argv[1]] + sys.argv[2:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_torchrun_at_world_size_one_starts_the_group_and_reduces_on_the_models_device(tiny_model, tmp_path):
    """What one H200 can show of the 8-GPU path: torchrun with one process still runs the process group,
    DDP and the metrics all-reduce, and no collective is handed a tensor copied to the CPU (NCCL refuses
    those: the first metrics all-reduce of a multi-GPU run died so)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "probe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(probe),
           str(REMOTE / "train.py"), "--target", str(tiny_model), "--data", str(chat_rows(tmp_path / "chat.jsonl")),
           "--out", str(tmp_path / "run"), "--steps", "3", "--batch-tokens", "512", "--ttt-steps", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PROBE_OUT": str(out)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert len(seen["groups"]) == 1 and seen["model_devices"] == ["cpu"]
    metric_reduces = [c for c in seen["collectives"] if c["op"] == "all_reduce"]
    assert len(metric_reduces) >= 3  # one per step
    for c in seen["collectives"]:
        assert c["device"] == seen["model_devices"][0] and not c["moved_to_cpu"], c
    assert len(metrics(tmp_path / "run")) == 3


# ---------------------------------------------------------------- the step at scale, against the plain one


# ---------------------------------------------------------------- the plan


def test_draft_shape_flags_reach_the_exported_config(tiny_model, tmp_path):
    out = train(tiny_model, chat_rows(tmp_path / "chat.jsonl"), tmp_path / "run", "--steps", "2", "--batch-tokens",
                "512", "--draft-heads", "2", "--draft-kv-heads", "1", "--draft-intermediate", "96")
    config = json.loads((out / "draft" / "config.json").read_text())
    H, D = config["hidden_size"], json.loads((tiny_model / "config.json").read_text())["head_dim"]
    assert H // 2 != D  # the heads keep the target's width, not hidden_size // heads
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["intermediate_size"]) == (2, 1, D, 96)
    tensors = load_file(out / "draft" / "model.safetensors")
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (2 * D, 2 * H)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (D, 2 * H)
    assert tensors["midlayer.mlp.down_proj.weight"].shape == (H, 96)
    assert json.loads((out / "train_plan.json").read_text())["draft"]["intermediate"] == 96
