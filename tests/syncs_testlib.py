"""Which ops would make the host wait for a GPU (a device value read back, an output sized by the
data), counted on any device (tests/test_pkm.py: a PKM training step syncs once)."""

#: ops that make the host wait for the device on CUDA, whatever device the count runs on: a
#: value read back (``.item()``, ``bool(t)``, ``float(t)``, ``torch.equal``), or an output whose
#: size the host must learn from the data (``nonzero``, ``unique*``, ``masked_select``;
#: ``bincount``, which reads its input's maximum). Each one drains the GPU's queue. Not seen by a
#: count on the CPU: ``.tolist()``, ``.numpy()`` and ``.cpu()``, which dispatch nothing there
HOST_SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select",
                 "unique_consecutive", "_unique", "_unique2", "unique_dim",
                 "unique_dim_consecutive", "bincount", "histc"}


def host_sync(func, args, kwargs) -> bool:
    """Whether the aten op ``func(*args, **kwargs)`` synchronises with the device on CUDA:
    :data:`HOST_SYNC_OPS`, indexing with a boolean mask (a ``nonzero`` inside ATen), and
    ``repeat_interleave`` without ``output_size``."""
    import torch

    name = func.overloadpacket.__name__
    if name in HOST_SYNC_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        index = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in index)
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    return False


class HostTensors:
    """Which tensors of a run on the CPU would stay on the host in the same run on a GPU, so that
    reading them back is no device sync: the outputs of tensor factories called without a device
    (``torch.tensor``, ``torch.arange``, ...: torch fills in the CPU before dispatch, so they are
    seen where they are called), shapes turned into tensors (fairseq's positional embedding), and
    whatever is computed from such tensors only. Everything else (parameters, batches, their
    products) would live on the GPU."""

    #: torch functions that make a tensor from nothing: on the host unless given a device
    FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "rand",
                 "randn", "randint", "linspace", "eye", "_shape_as_tensor"}

    def __init__(self):
        self.tensors = {}  # id -> weak reference (a WeakSet would compare tensors with ==)

    def __contains__(self, t) -> bool:
        ref = self.tensors.get(id(t))
        return ref is not None and ref() is t

    def add(self, tree):
        import weakref

        for t in self._leaves(tree):
            self.tensors[id(t)] = weakref.ref(t, lambda _, key=id(t): self.tensors.pop(key, None))

    @staticmethod
    def _leaves(tree):
        import torch
        from torch.utils._pytree import tree_leaves

        return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]

    def counting(self, on_op):
        """A context in which every aten op runs as usual and is reported as ``on_op(func,
        sync)``, ``sync``: whether it would make the host wait for the device on CUDA
        (:func:`host_sync`, unless every input stays on the host)."""
        import contextlib

        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        host = self

        class Factories(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if getattr(func, "__name__", None) in host.FACTORIES and kwargs.get("device") is None:
                    host.add(out)
                return out

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                inputs = host._leaves((args, kwargs))
                on_host = bool(inputs) and all(t in host for t in inputs)
                out = func(*args, **kwargs)
                if on_host:
                    host.add(out)
                on_op(func, not on_host and host_sync(func, args, kwargs))
                return out

        stack = contextlib.ExitStack()
        stack.enter_context(Factories())
        stack.enter_context(Ops())
        return stack


def syncs(run) -> list:
    """The names of the ops of ``run()`` that would make the host wait for the device on CUDA,
    in order (:meth:`HostTensors.counting`)."""
    names = []

    def count(func, sync):
        if sync:
            names.append(func.overloadpacket.__name__)

    with HostTensors().counting(count):
        run()
    return names
