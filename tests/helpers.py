"""Small models and comparisons shared by the tests."""

from __future__ import annotations

import torch
from torch import nn

import ckpt


def make_state(seed: int = 0, device: str = "cpu") -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(32, 5)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return {"model": model, "optim": opt, "sched": sched, "rng": ckpt.RNGState(),
            "meta": {"epoch": 0, "name": "run", "lrs": [1e-2, None, True], "inf": float("inf")}}


def train(state: dict, steps: int = 1) -> None:
    model, opt = state["model"], state["optim"]
    dev = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randn(16, 12).to(dev)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["sched"].step()
        state["meta"]["epoch"] += 1


def snapshot_values(state: dict) -> dict:
    """Deep copies of every tensor and value that a restore must reproduce."""
    opt = state["optim"]
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "optim": [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                  for g in opt.param_groups for p in g["params"]],
        "lr": [g["lr"] for g in opt.param_groups],
        "sched": dict(state["sched"].state_dict()),
        "rng": torch.get_rng_state().clone(),
        "meta": dict(state["meta"]),
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"model tensor {k} differs"
    assert len(a["optim"]) == len(b["optim"])
    for i, (x, y) in enumerate(zip(a["optim"], b["optim"])):
        assert x.keys() == y.keys()
        for k in x:
            if torch.is_tensor(x[k]):
                assert torch.equal(x[k], y[k]), f"optimizer state {i}/{k} differs"
                assert x[k].device == y[k].device and x[k].dtype == y[k].dtype
            else:
                assert x[k] == y[k]
    assert a["lr"] == b["lr"]
    assert a["sched"] == b["sched"]
    assert torch.equal(a["rng"], b["rng"])
    assert a["meta"] == b["meta"]
