"""Constant tensors made once and only ever read (imports torch only)."""

import functools

import torch


def cached_constant(make):
    """Decorate a tensor factory with hashable arguments (sizes, dtype, device) so that each
    distinct call makes its tensor once: a kernel or two per layer and step otherwise, the cost
    of a host-bound step. The tensor is made outside inference mode and autograd, so the same one
    serves training and generation; callers must not modify it (``fn.cache_clear()`` drops all)."""

    @functools.lru_cache(maxsize=None)
    @functools.wraps(make)
    def cached(*args):
        with torch.inference_mode(False), torch.no_grad():
            return make(*args)

    return cached
