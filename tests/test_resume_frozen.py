"""Issue 32, item 1: a SCAPE state saved after parameters joined the engine loads where they are frozen again.

This is what Lightning's ``BaseFinetuning`` does when a fit resumes, here on the bare engine in two simulated ranks:
the optimizer is built over what is trainable (the head), the param group of the backbone is put back while the
backbone is frozen, and only then does the state load (the Trainer's own flow, against DDP:
``tests/test_lightning_conformance.py``, issue 32). The reference is the uninterrupted run, and for a backbone
that stays frozen, a torch optimizer's handling of a frozen parameter: its state is kept, and its steps stop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import HID, LR, SCAPE, flat, make_batch, make_net
from torch import nn

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator, SoloCommunicator

# Chunks of 64 with 6 slots, 2 dense steps: the tiny net's head is one bucket, its body three once it joins.
CONFIG = ScapeConfig(**SCAPE)
UNFREEZE, SAVE, END = 3, 6, 10  # the body joins after step 3; the state is saved after step 6; the run ends at 10

Unfreeze = Callable[[nn.Sequential], list[nn.Parameter]]


def body(net: nn.Sequential) -> list[nn.Parameter]:
    """The first two layers (the "backbone"): one bucket of the second layer's bias, one of its weight, one of the
    first layer."""
    return [*net[0].parameters(), *net[2].parameters()]


def start(rank: int, comm: Communicator, weights: list[torch.Tensor] | None = None) -> tuple[Any, AdamS, ScapeEngine]:
    """The net with its body frozen, AdamS over the head, and the engine (``weights``: the checkpoint's)."""
    net = make_net()
    if weights is not None:
        with torch.no_grad():
            for p, w in zip(net.parameters(), weights, strict=True):
                p.copy_(w)
    for p in body(net):
        p.requires_grad_(False)
    opt = AdamS(net[4].parameters(), lr=LR)
    return net, opt, ScapeEngine(opt, CONFIG, comm, param_order=list(net.parameters()))


def train(engine: ScapeEngine, net: nn.Sequential, rank: int, steps: range) -> list[torch.Tensor]:
    """Optimizer steps on this rank's batches, parameters unfrozen since the last one joining first (what
    ``ScapeOptimizer.zero_grad`` does before the Trainer's backward pass); the parameters after each."""
    trace = []
    for t in steps:
        engine.add_trainable_params()
        x, y = make_batch(rank, t)
        (net(x) - y).pow(2).mean().backward()
        engine.step()
        engine.zero_grad()
        trace.append(flat(net.parameters()))
    return trace


def uninterrupted(rank: int, comm: Communicator) -> dict[str, Any]:
    """The body unfrozen after step 3 in a param group of its own; the state and weights after step 6."""
    net, opt, engine = start(rank, comm)
    trace = train(engine, net, rank, range(UNFREEZE))
    opt.add_param_group({"params": body(net), "lr": LR / 10})
    for p in body(net):
        p.requires_grad_(True)
    trace += train(engine, net, rank, range(UNFREEZE, SAVE))
    saved = {"state": engine.state_dict(), "weights": [p.detach().clone() for p in net.parameters()]}
    trace += train(engine, net, rank, range(SAVE, END))
    engine.close()
    return {"trace": trace, "saved": saved}


def resume(
    rank: int, comm: Communicator, saved: dict[str, Any], before_load: Unfreeze, after_load: Unfreeze, wait: int = 0
) -> dict[str, Any]:
    """Resume after step 6 as a resumed fit does: the body frozen, its param group put back (where parameters
    unfrozen ``before_load`` join at once), then the state loads; ``after_load`` is unfrozen ``wait`` steps later."""
    net, opt, engine = start(rank, comm, saved["weights"])
    opt.add_param_group({"params": body(net), "lr": LR / 10})
    for p in before_load(net):
        p.requires_grad_(True)
    engine.add_trainable_params()
    engine.load_state_dict(saved["state"])
    loaded = engine.state_dict()
    trace = train(engine, net, rank, range(SAVE, SAVE + wait))
    waited = engine.state_dict()
    for p in after_load(net):
        p.requires_grad_(True)
    engine.add_trainable_params()
    joined = {
        "layout": [(bs.layout.group_index, bs.layout.numel) for bs in engine.buckets],
        "buckets": [
            {"residual": bs.residual.clone(), "momentum": bs.momentum.clone(), "last_sent": bs.last_sent.clone(),
             "region": (bs.region.start, bs.region.stop), "first_step": bs.first_step,
             "places": {id(pl.param): pl.offset for pl in bs.layout.places}}
            for bs in engine.buckets
        ],
        "names": {id(p): n for n, p in net.named_parameters()},
    }  # fmt: skip
    trace += train(engine, net, rank, range(SAVE + wait, END))
    out = {"trace": trace, "loaded": loaded, "waited": waited, "joined": joined, "final": engine.state_dict()}
    engine.close()
    return out


@pytest.fixture(scope="module")
def whole() -> list[dict[str, Any]]:
    return simulate(2, uninterrupted)


def resumed(whole: list[dict[str, Any]], before: Unfreeze, after: Unfreeze, wait: int = 0) -> list[dict[str, Any]]:
    return simulate(2, lambda rank, comm: resume(rank, comm, whole[rank]["saved"], before, after, wait))


def nothing(net: nn.Sequential) -> list[nn.Parameter]:
    return []


def test_a_backbone_unfrozen_again_before_the_next_step_continues_bitwise(whole: list[dict[str, Any]]) -> None:
    """Frozen when the state loads (its buckets wait), unfrozen before the next step: laid out as saved, with its
    state and masks, the run is the uninterrupted one, and so is a state saved while the body waited."""
    outs = resumed(whole, nothing, body)
    for w, o in zip(whole, outs, strict=True):
        saved = w["saved"]["state"]
        assert o["loaded"]["layout"] == saved["layout"] and len(saved["layout"]) == 4  # the head, the body's 3
        assert all(torch.equal(a, b) for a, b in zip(o["trace"], w["trace"][SAVE:], strict=True))
        assert o["final"]["layout"] == saved["layout"]


def test_a_bucket_laid_out_before_the_state_loads_is_laid_out_again_as_saved(whole: list[dict[str, Any]]) -> None:
    """A parameter of the body trainable when the param groups are put back (as the BatchNorm layers that
    ``BaseFinetuning(train_bn=True)`` leaves trainable) joins at once, in a bucket of its own; the state that loads
    lays it out again as it saved it, and the run is the uninterrupted one once the rest is unfrozen."""
    outs = resumed(whole, lambda net: [net[0].bias], body)
    for w, o in zip(whole, outs, strict=True):
        assert o["loaded"]["layout"] == w["saved"]["state"]["layout"]
        assert all(torch.equal(a, b) for a, b in zip(o["trace"], w["trace"][SAVE:], strict=True))
        assert o["final"]["layout"] == w["saved"]["state"]["layout"]


def test_a_backbone_that_stays_frozen_keeps_its_state_and_does_not_move(whole: list[dict[str, Any]]) -> None:
    """As under AdamW, a frozen parameter's state is kept and its steps stop: the body does not move while the head
    trains; when it joins 2 steps later its momentum and residual are the saved ones, and its first and last-sent
    steps have moved on by the 2 steps it waited."""
    outs = resumed(whole, nothing, body, wait=2)
    n_body = sum(p.numel() for p in body(make_net()))
    for w, o in zip(whole, outs, strict=True):
        saved = w["saved"]["state"]["buckets"]
        head_numel = sum(p.numel() for p in make_net()[4].parameters())
        first, second = o["trace"][0], o["trace"][1]
        assert torch.equal(first[:n_body], flat(w["saved"]["weights"])[:n_body])  # the body, first in the net
        assert torch.equal(second[:n_body], first[:n_body]) and not torch.equal(second[n_body:], first[n_body:])
        assert second.numel() == n_body + head_numel
        waited = o["waited"]  # saved while waiting: the body's buckets as loaded, their steps moved on
        assert waited["layout"] == w["saved"]["state"]["layout"] and waited["step_count"] == SAVE + 2
        for before, after in zip(saved[1:], waited["buckets"][1:], strict=True):
            assert torch.equal(after["momentum"], before["momentum"])
            assert torch.equal(after["residual"], before["residual"])
            assert torch.equal(after["last_sent"], before["last_sent"] + 2)
            assert after["first_step"] == before["first_step"] + 2 == UNFREEZE + 2 and after["masks"] == []
        joined = o["joined"]["buckets"]
        for before, after in zip(saved[1:], joined[1:], strict=True):
            assert torch.equal(after["momentum"], before["momentum"]) and after["first_step"] == UNFREEZE + 2
            assert torch.equal(after["residual"], before["residual"])
            assert torch.equal(after["last_sent"], before["last_sent"] + 2)


def test_parameters_of_a_partly_trainable_saved_bucket_continue_from_their_coordinates(
    whole: list[dict[str, Any]],
) -> None:
    """Only the first layer's bias unfrozen (its weight shares its saved bucket): it joins a bucket of its own with
    its saved coordinates' residual, momentum (gathered from the rank that owned them) and last-sent steps, and the
    bucket's first step; the weight waits on, and a state saved now still holds it."""
    outs = resumed(whole, nothing, lambda net: [net[0].bias])
    saved = [w["saved"]["state"] for w in whole]
    # The saved bucket of the first layer (the last one): its momentum, sharded over the two ranks, whole.
    momentum = torch.cat([s["buckets"][3]["momentum"] for s in saved])
    last_sent = torch.cat([s["buckets"][3]["last_sent"] for s in saved])
    joined_momentum = torch.cat([o["joined"]["buckets"][1]["momentum"] for o in outs])
    joined_last_sent = torch.cat([o["joined"]["buckets"][1]["last_sent"] for o in outs])
    for s, o in zip(saved, outs, strict=True):
        assert o["joined"]["layout"] == [(0, 328), (1, 40)]  # the head, then the bias alone
        (bias_id,) = [k for k, n in o["joined"]["names"].items() if n == "0.bias"]
        new = o["joined"]["buckets"][1]
        assert new["places"] == {bias_id: 0} and new["first_step"] == UNFREEZE
        # Where the bias sat in the saved bucket: the places are in reverse registration order, the bias first.
        assert torch.equal(new["residual"][:HID], s["buckets"][3]["residual"][:HID])
        assert len(o["final"]["layout"]) == 5 and o["final"]["layout"][-3:] == s["layout"][1:]
    assert torch.equal(joined_momentum[:HID], momentum[:HID]) and momentum[:HID].abs().sum() > 0
    assert torch.equal(joined_last_sent[:HID], last_sent[:HID])


def test_a_state_whose_set_up_buckets_it_does_not_hold_is_refused(whole: list[dict[str, Any]]) -> None:
    """The buckets laid out when the optimizer was set up must be the state's first ones (here the optimizer holds
    the body, trainable, in its first group and the head in its second); a state with waiting buckets cannot be
    re-sharded."""

    def load_body_first(rank: int, comm: Communicator) -> str:
        net = make_net()
        opt = AdamS([{"params": body(net)}, {"params": list(net[4].parameters())}], lr=LR)
        engine = ScapeEngine(opt, CONFIG, comm, param_order=list(net.parameters()))
        with pytest.raises(ValueError, match="another bucket layout") as info:
            engine.check_state_dict(whole[rank]["saved"]["state"])
        return str(info.value)

    (message, _) = simulate(2, load_body_first)
    assert "the buckets laid out when the optimizer was set up must be the saved state's first ones" in message

    net, opt, engine = start(0, SoloCommunicator())  # one process: the two ranks' state re-sharded onto it
    opt.add_param_group({"params": body(net), "lr": LR / 10})
    with pytest.raises(ValueError, match="re-sharding needs every saved bucket's parameters trainable"):
        engine.reshard_state_dicts([w["saved"]["state"] for w in whole])
