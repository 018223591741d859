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

from tests.fixtures_train import REMOTE, ROOT, metrics, run_script, train, train_args
from tests.plain_step import reference_step

sys.path.insert(0, str(REMOTE))
from chat_render import ChatRenderer, normalise  # noqa: E402
from draft_model import DraftConfig, Eagle3Draft, check_tensor_names, expected_tensor_names, export_tensors  # noqa: E402
from target_states import OnlineTargetStates  # noqa: E402
from ttt_objective import SoftCrossEntropy, target_distribution  # noqa: E402

LAYER_NAMES = {
    "fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
}


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


# ---------------------------------------------------------------- training and export


def test_training_loss_falls_and_first_position_accuracy_rises(trained_run):
    rows = metrics(trained_run)
    assert len(rows) == 300 and [r["step"] for r in rows] == list(range(1, 301))
    head, tail = rows[:10], rows[-10:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(tail, "loss") < 0.5 * mean(head, "loss")
    assert mean(tail, "acc_0") > mean(head, "acc_0") + 0.3
    assert {"acc_0", "acc_1", "acc_2", "sim_al", "tokens_per_s", "lr"} <= set(rows[-1])


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


def test_exporter_refuses_any_other_tensor_set():
    c = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    vocab_size=100, draft_vocab_size=40, aux_layer_ids=[0, 1, 2], max_position_embeddings=256)
    assert expected_tensor_names(c) == LAYER_NAMES | {"d2t", "t2d"}
    draft = Eagle3Draft(c, torch.randn(100, 32), torch.arange(0, 80, 2))
    tensors = export_tensors(draft, torch.float32)
    assert torch.equal(tensors["d2t"] + torch.arange(40), torch.arange(0, 80, 2))
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].sum() == 40
    with pytest.raises(ValueError, match="missing.*d2t"):
        check_tensor_names(LAYER_NAMES, c)
    with pytest.raises(ValueError, match="unexpected.*embed_tokens"):
        check_tensor_names(set(tensors) | {"embed_tokens.weight"}, c)
    draft.extra = torch.nn.Linear(2, 2)  # a module the vLLM class does not have
    with pytest.raises(ValueError, match="unexpected.*extra.weight"):
        export_tensors(draft, torch.float32)


def test_resume_ends_with_the_same_weights_as_an_uninterrupted_run(tiny_model, generated_data, tmp_path):
    args = ["--steps", "60", "--save-every", "5", "--batch-tokens", "512"]
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


def test_torchrun_two_cpu_processes_train_and_export(tiny_model, generated_data, trained_run, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REMOTE / "train.py"), "--target", str(tiny_model), "--data", str(generated_data), "--out", str(out),
           "--steps", "8", "--batch-tokens", "1024", "--ttt-steps", "3", "--lr", "1e-2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
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


def chat_rows(path, n=12):
    """A few conversations in OpenAI `messages` form (no server needed)."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What is {i} + {i + 3}?"},
                {"role": "assistant", "content": f"{i} + {i + 3} = {2 * i + 3}. Count on from {i}: "
                                                 + " ".join(str(i + j) for j in range(1, 4)) + "."}]}) + "\n")
    return path


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


def test_memory_lean_step_has_the_plain_steps_loss_and_gradients():
    """Checkpointed steps, diagonal attention, chunked soft cross-entropy, draft-vocab target logits: the
    same loss, accuracy counts and gradients as the plain step, on the tiny target's shape (chunks made
    small so every chunked path runs several times)."""
    torch.manual_seed(0)
    H, V, Vd, B, T, k = 128, 576, 24, 2, 48, 4
    c = DraftConfig(hidden_size=H, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    vocab_size=V, draft_vocab_size=Vd, aux_layer_ids=[0, 1, 2], max_position_embeddings=512)
    vocab_ids = torch.randperm(V)[:Vd].sort().values
    draft = Eagle3Draft(c, torch.randn(V, H), vocab_ids)
    for p in draft.parameters():  # norms off 1.0, so their gradients mean something
        if p.requires_grad and p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    in_vocab = torch.zeros(V, dtype=torch.bool)
    in_vocab[vocab_ids] = True
    input_ids = torch.randint(0, V, (B, T))
    aux = torch.randn(B, T, 3 * H)
    loss_mask = (torch.rand(B, T) < 0.7).long()
    # The target agrees with the draft's first guess on some tokens and puts its argmax outside the draft
    # vocab on others, so accuracy counts and the loss's in-vocab filter both have something to count.
    normed, head = torch.randn(B, T, H) * 0.1, torch.randn(V, H) * 0.1
    head[vocab_ids] += 5 * torch.eye(H)[:Vd]
    with torch.no_grad():
        first = draft.lm_head(draft.norm(draft.midlayer(
            draft.embed_tokens(input_ids[:, 1:]), draft.fc(aux[:, :-1]),
            *draft.rotary(aux, torch.arange(T - 1).expand(B, T - 1)), [])[0])).argmax(-1)
    agree = torch.rand(B, T - 1) < 0.5
    normed[:, 1:][agree] += 5 * torch.eye(H)[first[agree]]

    ref_loss, ref_correct, ref_counted = reference_step(draft, input_ids, aux, k, normed @ head.T, loss_mask,
                                                        vocab_ids, in_vocab, 0.8)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    draft.zero_grad(set_to_none=True)

    target_vd, target_top = target_distribution(normed, head, head[vocab_ids], vocab_chunk=37)
    assert torch.equal(target_top, (normed @ head.T).argmax(-1))
    objective = SoftCrossEntropy(draft, target_vd, target_top, loss_mask, vocab_ids, in_vocab, 0.8, chunk_rows=7)
    per_step = draft(input_ids, aux, k, objective)
    loss = sum(r[0] for r in per_step)
    loss.backward()
    assert ref_counted.sum() > ref_correct.sum() > 0  # the accuracy counts are not trivially all or nothing
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.stack([r[1] for r in per_step]), ref_correct)
    assert torch.equal(torch.stack([r[2] for r in per_step]), ref_counted)
    for name, g in ref_grads.items():
        got = dict(draft.named_parameters())[name].grad
        assert g.abs().max() > 0, name
        torch.testing.assert_close(got, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- the plan


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


def test_draft_shape_flags_reach_the_exported_config(tiny_model, tmp_path):
    out = train(tiny_model, chat_rows(tmp_path / "chat.jsonl"), tmp_path / "run", "--steps", "2", "--batch-tokens",
                "512", "--draft-heads", "2", "--draft-kv-heads", "1", "--draft-intermediate", "96")
    config = json.loads((out / "draft" / "config.json").read_text())
    H = config["hidden_size"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["intermediate_size"]) == (2, 1, H // 2, 96)
    tensors = load_file(out / "draft" / "model.safetensors")
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (H, 2 * H)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (H // 2, 2 * H)
    assert tensors["midlayer.mlp.down_proj.weight"].shape == (H, 96)
    assert json.loads((out / "train_plan.json").read_text())["draft"]["intermediate"] == 96


def test_plans_activation_bytes_per_token_agree_with_a_cpu_measurement():
    """Peak memory of one real step at T and 2T tokens, at a reduced width (Kimi's draft / 32, 3 TTT steps: not
    the shapes the plan's constant was measured at), against the plan's bytes per token: within 25 %."""
    sys.path.insert(0, str(ROOT / "bench"))
    import train_memory

    shape = train_memory.scaled(32)
    measured = train_memory.measured_bytes_per_token(shape, 1024, 3, "after")
    planned = train_memory.planned_bytes_per_token(shape, 1024, 3)
    assert abs(planned - measured) <= 0.25 * measured, (planned, measured)
