"""remote/muon.py: the orthogonalization, which parameters Muon takes, and AdamW's half being torch's AdamW."""
import io
import sys

import torch

from tests.helpers.fixtures_train import REMOTE

sys.path.insert(0, str(REMOTE))
from muon import MuonAdamW, orthogonalize  # noqa: E402


def test_orthogonalize_flattens_the_spectrum_of_wide_and_tall_matrices():
    torch.manual_seed(0)
    for shape in [(64, 192), (192, 64), (128, 128)]:
        u, _ = torch.linalg.qr(torch.randn(shape[0], min(shape)))
        v, _ = torch.linalg.qr(torch.randn(shape[1], min(shape)))
        spectrum = torch.logspace(-1, 1, min(shape))  # two decades, as a gradient's are
        g = u @ torch.diag(spectrum) @ v.T
        after = torch.linalg.svdvals(orthogonalize(g))
        assert after.min() > 0.5 and after.max() < 1.3, (shape, after.min(), after.max())
        assert orthogonalize(g).shape == g.shape


def test_muon_takes_the_hidden_matrices_and_adamw_the_norms_and_head():
    net = torch.nn.ModuleDict({"fc": torch.nn.Linear(6, 4, bias=False), "norm": torch.nn.LayerNorm(4),
                               "lm_head": torch.nn.Linear(4, 5, bias=False)})
    net["norm"].bias.requires_grad_(False)
    opt = MuonAdamW(net.named_parameters(), muon_lr=0.02, adam_lr=1e-3)
    by_kind = {g["muon"]: g["params"] for g in opt.param_groups}
    assert by_kind[True] == [net["fc"].weight]
    assert by_kind[False] == [net["norm"].weight, net["lm_head"].weight]
    assert [g["lr"] for g in opt.param_groups] == [0.02, 1e-3]


def test_the_adamw_half_steps_exactly_as_torch_adamw():
    torch.manual_seed(0)
    ours, theirs = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
    theirs.load_state_dict(ours.state_dict())
    a = MuonAdamW(ours.named_parameters(), muon_lr=0.02, adam_lr=1e-2)
    b = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(5):
        x = torch.randn(3, 8)
        for net, opt in ((ours, a), (theirs, b)):
            opt.zero_grad()
            net(x).pow(3).sum().backward()
            opt.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_muon_fits_a_linear_map_and_its_state_round_trips():
    torch.manual_seed(0)
    truth, x = torch.randn(16, 32), torch.randn(256, 32)
    net = torch.nn.Linear(32, 16, bias=False)
    opt = MuonAdamW(net.named_parameters(), muon_lr=0.1, adam_lr=1e-3)

    def step(net, opt):
        opt.zero_grad()
        loss = (net(x) - x @ truth.T).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    first = step(net, opt)
    for _ in range(300):
        last = step(net, opt)
    assert last < 0.05 * first
    copy = torch.nn.Linear(32, 16, bias=False)
    copy.load_state_dict(net.state_dict())
    resumed = MuonAdamW(copy.named_parameters(), muon_lr=0.1, adam_lr=1e-3)
    saved = io.BytesIO()  # as a checkpoint does: a copy, not the live buffers
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved))
    step(net, opt), step(copy, resumed)
    assert torch.equal(net.weight, copy.weight)
