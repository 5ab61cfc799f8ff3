"""An FSDP unit's reduce-scatter input back into the capture row (gradstat/capture/fsdp.py)
and what a row lacking a unit becomes (gradstat/capture/fsdp_row.py), without processes:
the input is built here the way FSDP's ``chunk_cat`` builds it, from its documentation
(each gradient that requires grad, padded on dim 0 to a multiple of the world size, or cut
on its shard dim and stacked on dim 0, viewed as ``(world, -1)`` and concatenated)."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradstat.capture.fsdp import ParamSlot, UnitLayout
from gradstat.capture.fsdp_row import UnitArrivals
from gradstat.errors import GradstatWarning

# name, shape, shard dim, requires grad
PARAMS = [
    ("a", (5, 3), 0, True),
    ("frozen", (4,), 0, False),
    ("b", (3, 6), 1, True),
    ("c", (1,), 0, True),
]


def _chunk_cat(grads: list[tuple[torch.Tensor, int]], world: int) -> torch.Tensor:
    pieces = []
    for grad, dim in grads:
        if dim == 0:
            rows = -(-grad.shape[0] // world) * world
            padded = torch.zeros((rows, *grad.shape[1:]))
            padded[: grad.shape[0]] = grad
        else:
            padded = torch.cat(torch.chunk(grad, world, dim=dim), dim=0)
        pieces.append(padded.reshape(world, -1))
    return torch.cat(pieces, dim=1).reshape(-1)


def _unit(name: str, offset: int = 0) -> tuple[UnitLayout, dict[str, torch.Tensor]]:
    """A unit over PARAMS (the frozen one not recorded), its gradients and their offsets."""
    slots, grads = [], {}
    for param_name, shape, dim, trainable in PARAMS:
        param = torch.zeros(shape, requires_grad=trainable)
        slots.append(ParamSlot(shape, dim, offset if trainable else None, param))
        if trainable:
            grads[param_name] = torch.randn(shape)
            offset += param.numel()
    return UnitLayout(name, slots, 3, 1, 1.0, torch.float32), grads


def test_the_row_holds_each_trainable_gradient_and_skips_frozen_ones():
    torch.manual_seed(0)
    layout, grads = _unit("u")
    dims = {name: dim for name, _, dim, _ in PARAMS}
    flat = _chunk_cat([(grads[n], dims[n]) for n in grads], 3)
    row = torch.full((sum(g.numel() for g in grads.values()),), float("nan"))
    assert layout.copy_into(row, flat, 3, non_blocking=False)
    expected = torch.cat([g.reshape(-1) for g in grads.values()])
    assert torch.equal(row, expected)


def test_an_input_without_every_trainable_gradient_copies_nothing():
    torch.manual_seed(0)
    layout, grads = _unit("u")
    flat = _chunk_cat([(grads["a"], 0), (grads["c"], 0)], 3)  # "b" got no gradient
    row = torch.full((30,), 7.0)
    assert not layout.copy_into(row, flat, 3, non_blocking=False)
    assert torch.all(row == 7.0)


def test_a_parameter_frozen_after_the_capture_began_is_recorded_as_zeros():
    torch.manual_seed(0)
    layout, grads = _unit("u")
    layout.slots[2].param.requires_grad_(False)  # "b", recorded, now frozen
    flat = _chunk_cat([(grads["a"], 0), (grads["c"], 0)], 3)
    row = torch.full((34,), float("nan"))
    assert layout.copy_into(row, flat, 3, non_blocking=False)
    expected = torch.cat([grads["a"].reshape(-1), torch.zeros(18), grads["c"]])
    assert torch.equal(row, expected)


def test_units_that_never_arrive_are_zeros_and_warned_once_then_summarised():
    torch.manual_seed(0)
    first, grads = _unit("first")
    second, _ = _unit("second", offset=34)
    arrivals = UnitArrivals([first, second], rank=0)
    flat = _chunk_cat([(grads["a"], 0), (grads["b"], 1), (grads["c"], 0)], 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (4, 5, 6):
            row = torch.full((68,), float("nan"))
            arrivals.clear()
            assert first.copy_into(row, flat, 3, non_blocking=False)
            arrivals.arrived(first, whole=True)
            assert arrivals.finish(row, step)
            assert torch.all(row[34:] == 0) and torch.all(torch.isfinite(row))
        arrivals.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, GradstatWarning)]
    assert len(messages) == 2
    assert "step 4: FSDP unit second did not reduce-scatter" in messages[0]
    assert "FSDP unit second: 3 steps recorded as zeros (4, 5, 6)" in messages[1]


def test_a_unit_that_arrives_in_part_drops_the_row():
    first, _ = _unit("first")
    arrivals = UnitArrivals([first], rank=1)
    arrivals.arrived(first, whole=False)
    assert arrivals.seen(first)
    with pytest.warns(GradstatWarning, match=r"rank 1\): step 9: FSDP unit first reduce"):
        assert not arrivals.finish(torch.zeros(34), 9)
