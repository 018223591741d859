"""The trainer's parts that need no target: the exported tensor set, and the memory-lean step against a
plain one. The memory plan is tested in tests/torch/test_memory_plan.py."""
import sys

import pytest
import torch

from tests.helpers.fixtures_train import LAYER_NAMES, REMOTE
from tests.helpers.plain_step import reference_step

sys.path.insert(0, str(REMOTE))
from draft_model import DraftConfig, Eagle3Draft, check_tensor_names, expected_tensor_names, export_tensors  # noqa: E402
from ttt_objective import SoftCrossEntropy, target_distribution  # noqa: E402


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


@pytest.mark.parametrize("checkpoint, skip_unused", [(True, True), (False, True), (True, False)],
                         ids=["gpu-path", "cpu-path", "every-slot"])
def test_memory_lean_step_has_the_plain_steps_loss_and_gradients(checkpoint, skip_unused):
    """Checkpointed steps and loss chunks (or neither: the CPU path), diagonal attention, chunked soft cross-entropy,
    draft-vocab target logits, the MLP on used slots only: the same loss, accuracy counts and gradients
    as the plain step, on the tiny target's shape (chunks made small so every chunked path runs several
    times; prompt and padding slots skip the MLP)."""
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
    # Like conversations: a prompt, an answer, a second turn's prompt and answer; then padding.
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask[0, 8:28] = loss_mask[0, 34:48] = loss_mask[1, 12:36] = 1
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

    target_vd, target_top, top_p = target_distribution(normed, head, head[vocab_ids], vocab_chunk=37, with_top_p=True)
    assert torch.equal(target_top, (normed @ head.T).argmax(-1))
    torch.testing.assert_close(top_p, (normed @ head.T).softmax(-1).max(-1).values)
    assert 0.1 < (top_p >= 0.9).float().mean() < 0.9  # both sides of acceptance.SURE
    objective = SoftCrossEntropy(draft, target_vd, target_top, loss_mask, vocab_ids, in_vocab, 0.8, chunk_rows=7,
                                 recompute=checkpoint)
    used = objective.used_slots(k) if skip_unused else None
    if skip_unused:
        assert 0.1 < 1 - used[0].float().mean() and used[-1].sum() < used[0].sum()  # some slots skip
    per_step = draft(input_ids, aux, k, objective, checkpoint=checkpoint, used=used)
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


def test_importing_the_trainer_leaves_the_environment_alone():
    """train.py sets the CUDA allocator's expandable segments in main on a GPU only: set at import, it went
    from the importing process (a test run) into every vLLM it started, and vLLM refuses a KV connector
    under it (CI's extraction tests failed so)."""
    import os
    import subprocess

    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); before = dict(os.environ); import train; "
            "sys.exit(dict(os.environ) != before)")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    assert subprocess.run([sys.executable, "-c", code, str(REMOTE)], env=env, timeout=120).returncode == 0


def test_bf16_mlp_matmuls_keep_fp32_weights_and_results_within_bf16_rounding():
    """The CPU's bf16 MLP (train.py turns it on where the CPU multiplies bf16): fp32 in and out, fp32 gradients,
    within bf16's rounding of the fp32 MLP, and the rows padded for the kernel never reach the result."""
    from draft_model import MLP

    torch.manual_seed(0)
    c = DraftConfig(hidden_size=128, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    vocab_size=512, draft_vocab_size=256, aux_layer_ids=[0, 1, 2], max_position_embeddings=512)
    mlp = MLP(c)
    for shape in [(37, 128), (2, 45, 128)]:  # row counts that are no multiple of the padding's
        x = torch.randn(*shape, requires_grad=True)
        outputs, grads = [], []
        for bf16 in (False, True):
            mlp.bf16_matmuls = bf16
            out = mlp(x)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outputs.append(out.detach())
            grads.append([x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())])
            x.grad = None
            mlp.zero_grad(set_to_none=True)
        assert outputs[1].shape == shape and outputs[1].dtype == torch.float32
        assert torch.allclose(outputs[1], outputs[0], rtol=0.05, atol=0.02 * outputs[0].abs().max().item())
        assert not torch.equal(outputs[1], outputs[0])  # it did multiply in bf16
        for g32, g16 in zip(*grads):
            assert g16.dtype == torch.float32
            assert torch.allclose(g16, g32, rtol=0.05, atol=0.03 * g32.abs().max().item())
    assert all(p.dtype == torch.float32 for p in mlp.parameters())
