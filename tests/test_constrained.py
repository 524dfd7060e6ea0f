"""The bounded-parameter projection (``fairseq_attnzoo/modules/constrained.py``): the hook is
attached to one optimizer (never global), works for optimizers that are not hashable, sees a
parameter swapped into a group of the same size, survives ``half()``/``to()`` under torch's
swap/overwrite conversion flags, and survives pickling."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

from fairseq_attnzoo.modules.constrained import (BoundedParameter, UnitIntervalParameter,
                                                 attach_projection)
from fairseq_attnzoo.modules.precision import Float32Module


class Span(Float32Module):
    """The shape of an adaptive span: a float32 module holding a UnitIntervalParameter."""

    def __init__(self):
        super().__init__()
        self.z = UnitIntervalParameter(torch.full((3,), 0.5))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.span = Span()


def _push_out_of_bounds(params, optimizer):
    """One SGD step that moves every bounded parameter to 0.5 + 10 (above its bound of 1)."""
    for p in params:
        p.grad = torch.full_like(p, -10.0)
    optimizer.step()


class UnhashableSGD(torch.optim.SGD):
    def __eq__(self, other):  # no __hash__: instances are unhashable
        return self is other


def test_projection_is_attached_to_one_optimizer_only():
    """No global hook: an optimizer without :func:`attach_projection` leaves the parameter out of
    its bounds; the handle removes the hook again."""
    z = UnitIntervalParameter(torch.full((3,), 0.5))
    plain = torch.optim.SGD([z], lr=1.0)
    _push_out_of_bounds([z], plain)
    assert torch.equal(z.detach(), torch.full((3,), 10.5))
    z = UnitIntervalParameter(torch.full((3,), 0.5))
    opt = torch.optim.SGD([z], lr=1.0)
    handle = attach_projection(opt)
    _push_out_of_bounds([z], opt)
    assert torch.equal(z.detach(), torch.ones(3))
    handle.remove()
    _push_out_of_bounds([z], opt)
    assert torch.equal(z.detach(), torch.full((3,), 11.0))


def test_unhashable_optimizer_steps_and_projects():
    z = UnitIntervalParameter(torch.full((3,), 0.5))
    opt = UnhashableSGD([z], lr=1.0)
    attach_projection(opt)
    with pytest.raises(TypeError):
        hash(opt)
    _push_out_of_bounds([z], opt)
    assert torch.equal(z.detach(), torch.ones(3))


def test_bounded_parameter_swapped_into_a_group_of_the_same_size_is_projected():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([a, b], lr=1.0)
    attach_projection(opt)
    _push_out_of_bounds([a, b], opt)  # the hook has seen this group: no bounded parameter
    z = UnitIntervalParameter(torch.full((3,), 0.5))
    opt.param_groups[0]["params"][1] = z  # same number of parameters
    _push_out_of_bounds([a, z], opt)
    assert torch.equal(z.detach(), torch.ones(3))


def test_projection_cache_holds_parameters_not_their_ids():
    """A parameter freed and replaced may get the same ``id``: the cache must still see the new
    object (it keeps the parameters it was computed for)."""
    from fairseq_attnzoo.modules.constrained import bounded_params_of

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=1.0)
    assert bounded_params_of(opt) == []
    group = opt.param_groups[0]["params"]
    data = torch.full((3,), 0.5)
    # a cache keyed by ids alone: the parameter is freed here and CPython gives its memory (its id)
    # to the next object of that size, the bounded parameter below, which then looks cached
    del group[0]
    z = UnitIntervalParameter(data)
    group.append(z)
    assert bounded_params_of(opt) == [z]


@pytest.fixture(params=["swap", "overwrite", "default"])
def conversion_flag(request):
    future = torch.__future__
    old = (future.get_swap_module_params_on_conversion(),
           future.get_overwrite_module_params_on_conversion())
    try:
        future.set_swap_module_params_on_conversion(request.param == "swap")
        future.set_overwrite_module_params_on_conversion(request.param == "overwrite")
        yield request.param
    finally:
        future.set_swap_module_params_on_conversion(old[0])
        future.set_overwrite_module_params_on_conversion(old[1])


@pytest.mark.parametrize("cast", ["half", "bfloat16", "cpu"])
def test_cast_keeps_float32_and_the_class_under_torch_conversion_flags(conversion_flag, cast):
    model = Model()
    if cast == "half":
        model.half()
    elif cast == "bfloat16":
        model.to(torch.bfloat16)
    else:
        model.to("cpu")
    z = model.span.z
    assert type(z) is UnitIntervalParameter
    assert z.dtype == torch.float32 and torch.equal(z.detach(), torch.full((3,), 0.5))
    assert model.proj.weight.dtype == {"half": torch.float16, "bfloat16": torch.bfloat16,
                                       "cpu": torch.float32}[cast]
    assert [n for n, _ in model.named_parameters()] == ["proj.weight", "proj.bias", "span.z"]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    attach_projection(opt)
    _push_out_of_bounds([z], opt)
    assert torch.equal(model.span.z.detach(), torch.ones(3))


def test_pickle_round_trip_keeps_the_class_and_the_projection():
    model = Model()
    clones = pickle.loads(pickle.dumps(model)), copy.deepcopy(model), _torch_round_trip(model)
    for clone in clones:
        z = clone.span.z
        assert type(z) is UnitIntervalParameter and z.requires_grad
        assert torch.equal(z.detach(), model.span.z.detach())
        opt = torch.optim.Adam(clone.parameters(), lr=1.0)
        attach_projection(opt)
        _push_out_of_bounds([z], opt)
        assert torch.equal(clone.span.z.detach(), torch.ones(3))


def _torch_round_trip(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_bounded_parameter_state_dict_holds_plain_tensors():
    state = Model().state_dict()
    assert type(state["span.z"]) is torch.Tensor
    assert not isinstance(state["span.z"], BoundedParameter)
