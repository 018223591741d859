"""Muon for the draft's weight matrices, AdamW for the rest: one optimizer, so one scheduler and one
checkpointed state.

Muon (Keller Jordan, 2024) keeps SGD momentum per weight matrix and steps along that momentum made
orthogonal: every singular direction of the update moves by about the same amount, where Adam's step is
dominated by a few. A short run learns more per token that way: on the demo's tiny target, the same steps
at the same cost measure more acceptance in vLLM (docs/tiny-draft-recipe.md keeps the numbers). Muon suits the
hidden matrices only (fc, attention, MLP): the norms' scales are vectors and the head starts as the
target's own, so those stay with AdamW (train.py --lr).

The orthogonalization is five Newton-Schulz iterations, not an SVD: in bf16 on a GPU, as published
Muon does, in fp32 on a CPU (bf16 is 30% faster there alone, no faster in a demo step, and measured
0.007 and 0.0005 lower for seeds 0 and 1). Their cost is what to weigh at scale: for a Kimi-shaped draft
(hidden 7168, MLP 18432) about 124 TFLOP a step on every DDP rank, a quarter of the matrices' own
forward and backward on 16k tokens at TTT 7. That is why AdamW stays train.py's default until Muon is
measured there (bench/gpu_check.sh times both). Pure torch, no project imports.
"""
import torch


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """U V^T of g = U S V^T, approximately (singular values land in about [0.7, 1.2]): the quintic
    Newton-Schulz iteration whose coefficients push every singular value of a unit-norm matrix up fast,
    on the smaller Gram matrix of the two."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    x = x / (x.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    for _ in range(steps):
        gram = x.T @ x if tall else x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, x, poly, beta=a) if tall else torch.addmm(x, poly, x, beta=a)
    return x.to(g.dtype)


def is_hidden_matrix(name: str, param: torch.nn.Parameter) -> bool:
    return param.ndim == 2 and not name.startswith("lm_head")


def muon_groups(named_params, muon_lr: float, adam_lr: float) -> list[dict]:
    """The trainable parameters as Muon's group (hidden matrices, at muon_lr) and AdamW's (the rest)."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if is_hidden_matrix(n, p)], "lr": muon_lr, "muon": True},
        {"params": [p for n, p in named if not is_hidden_matrix(n, p)], "lr": adam_lr, "muon": False},
    ]
    return [g for g in groups if g["params"]]


class MuonAdamW(torch.optim.Optimizer):
    """Groups with ``muon=True`` step by Muon (nesterov momentum, orthogonalized, scaled by
    sqrt(max(1, rows/cols)) so a tall matrix's rows move as far as a square one's); the others by AdamW.
    Each group's ``lr`` is its own, and LambdaLR scales them all alike."""

    def __init__(self, params, muon_lr: float | None = None, adam_lr: float | None = None, momentum: float = 0.95,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        """params: named parameters, split here by muon_groups; or groups that say already whether they are
        Muon's (ZeroRedundancyOptimizer hands each rank its share of the groups so)."""
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = muon_groups(params, muon_lr, adam_lr)
        super().__init__(params, dict(momentum=momentum, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if decay:
                    p.mul_(1 - lr * decay)
                if group["muon"]:
                    momentum = group["momentum"]
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(momentum).add_(p.grad)
                    update = orthogonalize(p.grad.add(buf, alpha=momentum))
                    p.add_(update, alpha=-lr * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)
                else:
                    (beta1, beta2), eps = group["betas"], group["eps"]
                    if not state:
                        state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                    state["step"] += 1
                    state["exp_avg"].lerp_(p.grad, 1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
                    denom = (state["exp_avg_sq"] / bias2).sqrt_().add_(eps)
                    p.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)
