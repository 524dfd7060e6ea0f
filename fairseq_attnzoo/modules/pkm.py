"""Product-key memory (PKM; Lample et al., 2019, "Large Memory Layers with Product Keys").

A sparse key-value memory with |K| = n_keys² slots that replaces a position-wise FFN. For every
token and head, the query q(x) (a linear map, optionally batch-normalised) is split in two halves
q¹, q²; each half is scored against its own set of n_keys sub-keys. The product key (a, b) has
score ⟨q¹, c_a⟩ + ⟨q², c'_b⟩, so the top-k product keys are among the k × k pairs of the two
per-half top-k lists -- an exact search over n_keys² keys at the cost of 2·n_keys dot products::

    I_1 = top_k(q¹ C), I_2 = top_k(q² C'),  I = top_k{ ⟨q¹,c_a⟩ + ⟨q²,c'_b⟩ : a ∈ I_1, b ∈ I_2 }
    w = softmax over I of the scores,        m(x) = Σ_{i ∈ I} w_i v_i      (summed over heads)

The layer in parts, each read on its own: :class:`QueryNetwork` (q(x): the query projection,
the float32 batch norm :class:`Float32BatchNorm1d` and its masked form, qk-norm's gain, query
dropout); :class:`~.pkm_search.ProductKeySearch` (:mod:`.pkm_search`: the sub-keys, the search's
dtype, the fused kernel or :class:`~.pkm_search._ProductTopk`, the softmax);
:class:`~.pkm_values.ValueRead` (:mod:`.pkm_values`: the value table, shared pools, sparse or
dense gradients, the value kernels or :class:`~.pkm_values._WeightedRowSum`); :class:`MemoryOutput`
(plain, the Memory+ "swilu" reference or the legacy gated output); and :class:`ProductKeyMemory`
(the options, checked; the parts in order, :meth:`ProductKeyMemory.values_read`; the padding).
The value table is an ``nn.EmbeddingBag(n_keys², v_dim, mode="sum")`` whose selected rows alone
get a gradient (``sparse=True``: a sparse one, for ``--optimizer pkm_adam``); on CUDA the search
and the read run as fused Triton kernels, with the PyTorch paths as their reference.

Choices (XLM's ``pq_fast`` memory is the reference; this is an independent implementation):

* keys: per head two learned sets [n_keys, k_dim/2], uniform(±1/√(k_dim/2)) like ``nn.Linear``;
  values: N(0, v_dim^-½); query network: ``Linear(d, heads·k_dim)`` (+ BatchNorm1d).
* padding: padded positions are masked (no op sized by the data: no host sync on CUDA, one graph
  under ``torch.compile``), or on the CPU removed (:data:`SKIP_PADS_ON`): either way they do not
  enter the batch-norm statistics, add nothing to any gradient (no row of a sparse value
  gradient), and output zeros. (XLM's batch norm counts pads, which is why it only supports
  unpadded stream batches.)
* position-wise: in eval mode (running batch-norm statistics) a token's output depends on that
  token only, so incremental decoding needs no cache.
* precision: the query net and the value table run in the model's dtype; batch norm and qk-norm
  in float32; queries and sub-keys then enter the search in the model's dtype (bf16/fp16 under
  ``--bf16``/``--fp16``/``--amp``, as both references search; ``search_dtype="float32"``: float32
  inputs), and the scores are summed in float32, so the top-k, the candidate sums and the
  softmax are float32 (docs/precision.md).

Memory+ options (Berges et al., 2024, "Memory Layers at Scale"; independent implementation):

* ``values=<another memory's table>``: several memories read ONE value table (the memory code's
  ``mem_share_values``, on in ``apps/main/configs/pkplus_373m_1024k.yaml``), each with its own
  query network and sub-keys. The first memory owns (registers, initialises, checkpoints) the
  table; the others hold a plain reference.
* ``swilu="reference"``: the SiLU-gated ("swilu") output of facebookresearch/memory,
  ``out = Drop_v(W₂(m(x̃) ⊙ SiLU(W₁ x̃)))`` with x̃ = Drop_in(x) the input after input dropout, W₁:
  d -> v_dim and W₂: v_dim -> d_out both with biases, weights N(0, d_out^-½).
  ``swilu="legacy"`` (``gated=True``): this project's form before issue 23, kept so that its
  checkpoints rebuild the same function: no biases, nn.Linear's init, gate on the undropped input,
  value dropout on m(x) before W₂.
* ``init="memplus"``: the reference code's other inits -- sub-keys uniform(±1/√k_dim), query
  weight Xavier-uniform (``init="xlm"``: uniform(±1/√(k_dim/2)) and nn.Linear's init).
* ``qk_norm=True`` (ours: the reference code has none, and what the paper says about qk-norm was
  not verified here): each half-query RMS-normalised with a learned gain g (init 1), each sub-key
  scaled to unit L2 norm, so a half score is ``⟨g ⊙ q/rms(q), c/‖c‖⟩`` (computed in fp32).
"""

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import pkm_search_triton, pkm_triton
from .feedforward import ZooFeedForward
# (SEARCH_DTYPES, product_topk, VALUES_GROUP: imported from here by the fairseq wiring and users)
from .pkm_search import SEARCH_DTYPES, ProductKeySearch, product_topk  # noqa: F401
from .pkm_values import VALUES_GROUP, ValueRead  # noqa: F401
from .precision import Float32Module, compute_dtype, float32_region

#: output forms: plain m(x); the reference's SiLU-gated "swilu" output; this project's pre-issue-23
#: gated output (kept for its checkpoints)
SWILU_FORMS = ("off", "reference", "legacy")
#: initialisations: XLM's (Lample et al.) or facebookresearch/memory's (Memory+)
INITS = ("xlm", "memplus")

#: devices where :meth:`ProductKeyMemory.forward` removes the pads (a ``nonzero``, no sync on
#: the host's own device; the pads' query, search and read are skipped: measured faster on the
#: CPU) instead of masking them (everywhere else, and under torch.compile)
SKIP_PADS_ON = ("cpu",)


def slot_counts(indices: Tensor, weights: Tensor, size: int) -> Tensor:
    """Z_i = Σ_x w(x)_i: total softmax weight each slot received (float64, length ``size``)."""
    return torch.bincount(indices.reshape(-1), weights=weights.reshape(-1).double(), minlength=size)


def usage_stats(counts: Tensor) -> Tuple[float, float]:
    """XLM's diagnostics (``eval_memory_usage`` in ``xlm/evaluation/evaluator.py``: ``mem_used``,
    ``mem_kl_w``) from slot weights Z: memory usage (fraction of slots with Z_i > 0) and
    KL(z ‖ uniform) with z = Z / ΣZ (0 = perfectly uniform; log N = a single slot)."""
    counts = counts.double()
    n = counts.numel()
    total = counts.sum()
    if total <= 0:
        return 0.0, 0.0
    z = counts[counts > 0] / total
    return float((counts > 0).sum()) / n, float((z * (z * n).log()).sum())


class Float32BatchNorm1d(Float32Module, nn.BatchNorm1d):
    """BatchNorm1d whose statistics, parameters and running averages stay float32 inside an
    fp16/bf16 model (as fairseq's ``Fp32BatchNorm``); input and output keep the caller's dtype.
    Same state-dict keys as ``nn.BatchNorm1d``; ``keep_float32``: the float32 output as it is."""

    def forward(self, x: Tensor, keep_float32: bool = False) -> Tensor:
        with float32_region(x.device):
            out = super().forward(x.float())
        return out if keep_float32 else out.to(x.dtype)

    def masked(self, x: Tensor, keep: Tensor) -> Tensor:
        """Training-mode batch norm of x [N, C] over the rows that ``keep`` [N] (bool) marks, in
        float32 (the output is float32): the statistics, their gradient and the running averages
        are those of the kept rows alone, as if the others were not there, with no op sized by
        the data. Fewer than two kept rows: the running statistics, which stay as they are (the
        unpadded path does the same with a batch of one token)."""
        with float32_region(x.device):
            rows = keep.unsqueeze(1)
            x = torch.where(rows, x.float(), 0.0)
            count = keep.sum()
            n = count.clamp(min=1).to(x.dtype)
            mean = x.sum(0) / n
            var = torch.where(rows, x - mean, 0.0).square().sum(0) / n
            enough = count >= 2
            if self.track_running_stats and self.running_mean is not None:
                with torch.no_grad():
                    self.num_batches_tracked.add_(enough.to(self.num_batches_tracked.dtype))
                    factor = (self.momentum if self.momentum is not None
                              else 1.0 / self.num_batches_tracked.clamp(min=1).to(x.dtype))
                    factor = torch.where(enough, factor, 0.0)
                    unbiased = var * n / (n - 1).clamp(min=1)
                    self.running_mean.lerp_(mean.detach(), factor)
                    self.running_var.lerp_(unbiased.detach(), factor)
                    use_batch = enough
            else:
                use_batch = torch.ones_like(enough)
            if self.running_mean is not None:
                mean = torch.where(use_batch, mean, self.running_mean)
                var = torch.where(use_batch, var, self.running_var)
            out = (x - mean) * torch.rsqrt(var + self.eps)
            return out * self.weight + self.bias if self.affine else out


class QueryNetwork:
    """The query network of :class:`ProductKeyMemory` (a part of it, read on its own): per-head
    queries q(x) = Drop_q(qk-norm(BN(W_q Drop_in(x)))), W_q ``query_proj`` [d -> H·k_dim], BN
    ``query_bn`` (:class:`Float32BatchNorm1d`, statistics over the real tokens alone), qk-norm's
    gain ``query_gain``; :meth:`_init_query` makes them, :meth:`reset_query` initialises them.
    It reads the module's ``input_dim``, ``heads``, ``k_dim``, ``init`` and dropouts."""

    def _init_query(self, batchnorm: bool, qk_norm: bool):
        width = self.heads * self.k_dim
        self.query_proj = nn.Linear(self.input_dim, width)  # q(x)
        self.query_bn = Float32BatchNorm1d(width) if batchnorm else None
        # qk-norm: the learned gain g of the RMS-normalised half-queries
        self.query_gain = nn.Parameter(torch.ones(width)) if qk_norm else None

    @property
    def qk_norm(self) -> bool:
        return self.query_gain is not None

    def reset_query(self):
        self.query_proj.reset_parameters()
        if self.init == "memplus":  # facebookresearch/memory: Xavier-uniform query weight
            nn.init.xavier_uniform_(self.query_proj.weight)
        if self.query_bn is not None:
            self.query_bn.reset_parameters()
        if self.query_gain is not None:
            nn.init.ones_(self.query_gain)

    def query(self, x: Tensor, dropped: bool = False, keep: Optional[Tensor] = None) -> Tensor:
        """[N, d] -> per-head queries [H, N, k_dim] in float32: the batch norm's float32 output
        (and qk-norm, query dropout, in float32) goes on as it is, not rounded through the
        model's dtype and cast back; :meth:`lookup` rounds it once to the search's dtype.
        ``dropped``: input dropout already done. ``keep`` [N] (bool): the real tokens; the
        others (pads) stay out of the batch statistics."""
        if not dropped:
            x = F.dropout(x, self.input_dropout, self.training)
        q = self.query_proj(x)
        if self.query_bn is not None:
            if keep is not None and self.training:
                q = self.query_bn.masked(q, keep)
            elif self.training and q.size(0) < 2:  # batch statistics need two tokens
                bn = self.query_bn
                with float32_region(q.device):
                    q = F.batch_norm(q.float(), bn.running_mean, bn.running_var, bn.weight,
                                     bn.bias, False, 0.0, bn.eps)
            else:
                q = self.query_bn(q, keep_float32=True)
        q = q.float()
        if self.query_gain is not None:
            q = self._normalize_query(q)
        q = F.dropout(q, self.query_dropout, self.training)
        return q.view(-1, self.heads, self.k_dim).transpose(0, 1)

    def _normalize_query(self, q: Tensor) -> Tensor:
        """qk-norm, query side: each half-query [N, H·k_dim] -> g ⊙ q / rms(q), in fp32."""
        half = q.float().view(q.size(0), -1, self.k_dim // 2)
        half = half * torch.rsqrt(half.square().mean(-1, keepdim=True) + 1e-6)
        return (half.view_as(q) * self.query_gain.float()).to(q.dtype)


class MemoryOutput:
    """The output form of :class:`ProductKeyMemory` (a part of it, read on its own), one of
    :data:`SWILU_FORMS`: m(x) as it is (through ``out_proj`` when v_dim != d_out), the Memory+
    reference's SiLU-gated output W₂(m(x̃) ⊙ SiLU(W₁ x̃)) (W₁ ``gate_proj``, W₂ ``gate_out``,
    with biases) or the legacy gated form; :meth:`_init_output` makes the maps,
    :meth:`reset_output` initialises them, :meth:`transform` is the layer's output for the real
    tokens. It reads the module's ``swilu``, ``input_dim``, ``v_dim``, ``output_dim``, dropouts
    and m(x) (:meth:`ProductKeyMemory.values_read`)."""

    def _init_output(self):
        v_dim, output_dim = self.v_dim, self.output_dim
        if self.swilu != "off":  # Memory+: out = W₂(m(x̃) ⊙ SiLU(W₁ x̃)); biases in the reference
            bias = self.swilu == "reference"
            self.gate_proj = nn.Linear(self.input_dim, v_dim, bias=bias)  # W₁
            self.out_proj = None
            self.gate_out = nn.Linear(v_dim, output_dim, bias=bias)  # W₂
        else:
            self.gate_proj = self.gate_out = None
            self.out_proj = (nn.Linear(v_dim, output_dim, bias=False) if v_dim != output_dim
                             else None)

    @property
    def gated(self) -> bool:
        return self.gate_proj is not None

    def reset_output(self):
        for lin in (self.gate_proj, self.gate_out):
            if lin is not None:
                lin.reset_parameters()  # legacy: nn.Linear's init; reference: biases keep it
                if self.swilu == "reference":  # W₁, W₂ ~ N(0, d_out^-½) as in the reference
                    nn.init.normal_(lin.weight, 0.0, self.output_dim ** -0.5)

    def read(self, x: Tensor, keep: Optional[Tensor] = None) -> Tensor:
        """m(x) for tokens x [N, d] -> [N, d_out] (plain output; with swilu the [N, v_dim] read
        that the gate multiplies), value dropout on the read as in XLM. ``keep``: as in
        :meth:`values_read`."""
        out = F.dropout(self.values_read(x, keep=keep), self.value_dropout, self.training)
        return out if self.out_proj is None else self.out_proj(out)

    def transform(self, x: Tensor, keep: Optional[Tensor] = None) -> Tensor:
        """The layer's output for tokens x [N, d] -> [N, d_out]; ``keep`` [N] (bool): the real
        tokens (the rows of the others are garbage: :meth:`forward` masks them)."""
        if self.swilu == "reference":  # Drop_v(W₂(m(x̃) ⊙ SiLU(W₁ x̃))), x̃ = Drop_in(x)
            x = F.dropout(x, self.input_dropout, self.training)
            out = self.gate_out(self.values_read(x, dropped=True, keep=keep)
                                * F.silu(self.gate_proj(x)))
            return F.dropout(out, self.value_dropout, self.training)
        out = self.read(x, keep)
        if self.swilu == "legacy":  # W₂(Drop_v(m(x)) ⊙ SiLU(W₁ x)), no biases
            out = self.gate_out(out * F.silu(self.gate_proj(x)))
        return out


class ProductKeyMemory(QueryNetwork, ProductKeySearch, ValueRead, MemoryOutput, ZooFeedForward):
    """Product-key memory layer: ``forward(x [T, B, d], padding_mask [B, T]) -> [T, B, d_out]``.

    Its parts (see the module): :class:`QueryNetwork`, :class:`~.pkm_search.ProductKeySearch`,
    :class:`~.pkm_values.ValueRead`, :class:`MemoryOutput`. Here: the options, checked; the
    parts made and initialised in the order that names their parameters and draws their
    initial values (checkpoints and same-seed runs depend on both); m(x) through the parts
    (:meth:`values_read`); the pads, masked or removed (:meth:`forward`)."""

    def __init__(self, input_dim: int, output_dim: Optional[int] = None, n_keys: int = 512,
                 heads: int = 4, knn: int = 32, k_dim: int = 256, v_dim: Optional[int] = None,
                 query_batchnorm: bool = True, input_dropout: float = 0.0,
                 query_dropout: float = 0.0, value_dropout: float = 0.0, sparse: bool = False,
                 values: Optional[nn.EmbeddingBag] = None, gated: bool = False,
                 qk_norm: bool = False, swilu: str = "off", init: str = "xlm",
                 kernel: str = "auto", residual_dropout: bool = False,
                 search_kernel: str = "auto", search_dtype: str = "model"):
        super().__init__()
        #: whether a host layer applies its residual dropout to this layer's output (read by
        #: the fairseq layers); off, as in both references: XLM adds the memory's output to the
        #: residual undropped (``xlm/model/transformer.py``, where only the FFN's output is
        #: dropped), the memory code's Llama block has no dropout (``lingua/transformer.py``)
        self.residual_dropout = bool(residual_dropout)
        #: value read and its gradients: "auto" = the Triton kernels (pkm_triton) on CUDA when
        #: Triton is importable, else the PyTorch reference; "triton" / "torch" force one
        self.kernel = pkm_triton.check_kernel(kernel)
        #: the product-key search and its backward: "auto" = the fused Triton kernel
        #: (pkm_search_triton) on CUDA for bf16/fp16 queries (float32 ones where its float32
        #: specialisation ships), else :class:`~.pkm_search._ProductTopk`; "triton" / "torch"
        #: force one
        self.search_kernel = pkm_search_triton.check_search_kernel(search_kernel)
        if search_dtype not in SEARCH_DTYPES:
            raise ValueError(f"PKM search_dtype must be one of {', '.join(SEARCH_DTYPES)}, got "
                             f"{search_dtype!r}")
        #: :data:`SEARCH_DTYPES`: the search's inputs in the model's dtype, or float32
        self.search_dtype = search_dtype
        if gated:  # the pre-issue-23 name of the legacy gated output
            swilu = "legacy" if swilu == "off" else swilu
        if swilu not in SWILU_FORMS:
            raise ValueError(f"PKM swilu must be one of {', '.join(SWILU_FORMS)}, got {swilu!r}")
        if init not in INITS:
            raise ValueError(f"PKM init must be one of {', '.join(INITS)}, got {init!r}")
        self.swilu, self.init = swilu, init
        output_dim = output_dim or input_dim
        v_dim = v_dim or output_dim
        if n_keys < 1 or heads < 1 or knn < 1 or v_dim < 1:
            raise ValueError("PKM n_keys, heads, knn and v_dim must be positive")
        if k_dim < 2 or k_dim % 2:
            raise ValueError(f"PKM k_dim must be even and >= 2 (two half-queries), got {k_dim}")
        if knn > n_keys:
            raise ValueError(f"PKM knn ({knn}) cannot exceed n_keys ({n_keys})")
        self.input_dim, self.output_dim = input_dim, output_dim
        self.n_keys, self.heads, self.knn, self.k_dim, self.v_dim = n_keys, heads, knn, k_dim, v_dim
        self.size = n_keys ** 2  # |K|
        self.input_dropout, self.query_dropout, self.value_dropout = (
            input_dropout, query_dropout, value_dropout)
        # the parts, in the order their parameters were always created (the state dict's order;
        # nn.Linear draws its own init from the RNG as it is made)
        self._init_query(query_batchnorm, qk_norm)
        self._init_search()
        self._init_values(values, sparse)
        self._init_output()
        self.reset_parameters()

    def reset_parameters(self):
        # the parts' inits in the order they always drew from the RNG
        self.reset_keys()
        self.reset_values()
        self.reset_query()
        self.reset_output()

    # ---- the memory read ---------------------------------------------------------------------
    def values_read(self, x: Tensor, dropped: bool = False, keep: Optional[Tensor] = None
                    ) -> Tensor:
        """m(x) = Σ_i w_i v_i for tokens x [N, d] -> [N, v_dim] (no value dropout): the query
        network, the search, the value read. ``dropped``: input dropout already done; ``keep``
        [N] (bool): the real tokens (the others' rows are garbage, which the caller masks)."""
        weights, indices = self.lookup(self.query(x, dropped, keep), self.search_dtype_for(x))
        out = self.read_slots(indices, weights, keep)
        # the dtype the layer computes in: autocast's for a float32 x inside autocast
        return out.to(compute_dtype(x))

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        padding_mask = self.padding(x, padding_mask)  # (checks x [T, B, C] first)
        t, b, c = x.shape
        flat = x.reshape(t * b, c)
        keep = None
        if padding_mask is not None:
            # the real tokens, time-major like ``flat``: pads are masked, not removed (removing
            # them is a ``nonzero``, a host sync on CUDA and a graph break under torch.compile),
            # except on the CPU (SKIP_PADS_ON)
            keep = ~padding_mask.transpose(0, 1).reshape(-1)
        if flat.size(0) == 0:
            return x.new_zeros(t, b, self.output_dim, dtype=compute_dtype(x))
        if keep is not None:
            if x.device.type in SKIP_PADS_ON and not torch.compiler.is_compiling():
                return self._without_pads(flat, keep).view(t, b, self.output_dim)
            # a pad's row computes from 0, whatever it holds (even inf: 0 · inf in a gradient)
            flat = torch.where(keep.unsqueeze(1), flat, 0.0)
        out = self.transform(flat, keep)
        if keep is not None:  # pads output 0, so their gradients are 0 too
            out = torch.where(keep.unsqueeze(1), out, 0.0)
        return out.view(t, b, self.output_dim)

    def _without_pads(self, flat: Tensor, keep: Tensor) -> Tensor:
        """The layer on the real tokens alone, the pads' rows 0: what masking computes, without
        the pads' work (:data:`SKIP_PADS_ON`)."""
        kept = keep.nonzero().squeeze(1)
        if kept.numel() == flat.size(0):
            return self.transform(flat)
        if kept.numel() == 0:
            return flat.new_zeros(flat.size(0), self.output_dim, dtype=compute_dtype(flat))
        out = self.transform(flat.index_select(0, kept))
        return out.new_zeros(flat.size(0), self.output_dim).index_copy(0, kept, out)

    def extra_repr(self) -> str:
        return (f"|K|={self.size} (n_keys={self.n_keys}²), heads={self.heads}, knn={self.knn}, "
                f"k_dim={self.k_dim}, v_dim={self.v_dim}, sparse={self.sparse}"
                + ("" if self.owns_values else ", values=shared (owned by another memory)")
                + (f", swilu={self.swilu}" if self.gated else "")
                + (f", init={self.init}" if self.init != "xlm" else "")
                + (", qk_norm" if self.qk_norm else "")
                + (f", kernel={self.kernel}" if self.kernel != "auto" else "")
                + (f", search_kernel={self.search_kernel}" if self.search_kernel != "auto" else "")
                + (f", search_dtype={self.search_dtype}" if self.search_dtype != "model" else "")
                + (", residual_dropout" if self.residual_dropout else ""))
