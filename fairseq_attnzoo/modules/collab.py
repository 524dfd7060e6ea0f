"""Collaborative multi-head attention (Cordonnier, Loukas & Jaggi 2020, "Multi-Head Attention:
Collaborate Instead of Concatenate").

Concatenated heads each own a key/query projection W_Q,i, W_K,i: d -> d_k. Collaborative heads
share one pair W̃Q, W̃K: d -> D̃k and differ only by a mixing vector m_i (row i of M [H, D̃k]):

    logits_i = ( (X W̃Q diag(m_i)) (Y W̃K)ᵀ + 1 (Y w_i)ᵀ ) / sqrt(D̃k / H)

where Y are the key-side inputs and w_i (row i of ``content_bias``, d -> H) is the content bias that
replaces the query bias of concatenated heads (b_Q,i W_K,iᵀ). Values and the output projection are
those of ordinary multi-head attention. With D̃k = H·d_k and block one-hot mixing this is *exactly*
concatenated multi-head attention (see :meth:`CollaborativeAttention.from_mha`).

Efficient formulation: the per-head mixing is applied to the queries only (q_i = X W̃Q diag(m_i));
the keys stay shared, so incremental decoding caches one [B, T, D̃k] key tensor (not H x d_k per
head), the [B, T, H] content bias and the values. Where the mixing is applied does not change the
function: q diag(m_i) kᵀ = q (k diag(m_i))ᵀ.

The authors' fairseq fork (jbcdnr/fairseq-collaborative-heads, behind the paper's WMT'14 table) is
the same attention with three other choices, each an option here: ``qk_bias=True`` (q_proj/k_proj
keep their biases b̃Q, b̃K -- logits (x W̃Q + b̃Q) diag(m_i) (y W̃K + b̃K)ᵀ, whose key-only term
b̃Q diag(m_i) W̃Kᵀ y plays the content bias -- instead of a free content bias w_i),
``scaling="head_dim"`` (1/sqrt(d/H), fairseq's head size, instead of 1/sqrt(D̃k/H)) and
``proj_init="fork"`` (fairseq's init rule as the fork inherits it: xavier gain 1/sqrt(2) on
q/k/v only when D̃k = d, plain xavier otherwise); its mixing init is ``mixing_init="xavier"``. The
fork mixes on the key side and caches per-head keys; we mix the queries (same logits). Its
``mixing_matrix`` parameter loads into ``mixing``.

Imports torch and ``.base`` only.
"""

import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import AttnContext, ZooAttention
from .constants import cached_constant
from .rotary import RotaryEmbedding
from .sdpa import init_like_fairseq_mha

MIXING_INITS = ("random", "concatenate", "xavier", "ones")
SCALINGS = ("key_dim", "head_dim")  # 1/sqrt(D̃k/H) (EPFL package) | 1/sqrt(d/H) (fairseq fork)
PROJ_INITS = ("mha", "fork")


@cached_constant
def _content_mixing(num_heads: int, width: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The content features' mixing rows: head i reads its own bias column, ``[I_H | 0]``
    ``[H, width]``."""
    return torch.eye(num_heads, width, dtype=dtype, device=device)


@cached_constant
def _zeros(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.zeros(rows, cols, dtype=dtype, device=device)


def concatenate_mixing(num_heads: int, key_dim: int) -> Tensor:
    """Block one-hot M [H, D̃k]: head i uses dims [i·D̃k/H, (i+1)·D̃k/H) (the last block is smaller
    when H does not divide D̃k): collaborative attention then equals concatenated heads."""
    block = int(math.ceil(key_dim / num_heads))
    mixing = torch.zeros(num_heads, key_dim)
    for i in range(num_heads):
        mixing[i, i * block:(i + 1) * block] = 1.0
    return mixing


class CollaborativeAttention(ZooAttention):
    """Multi-head attention whose heads share the key/query projections; time-first ``[T, B, C]``.

    Args:
        embed_dim: model dimension d (queries, values and output).
        num_heads: H.
        key_dim: shared key/query dimension D̃k (need not be a multiple of H).
        kdim / vdim: input dimension of keys / values (encoder dim for cross-attention).
        mixing_init: ``random`` N(0, 0.2²) (reference package default), ``concatenate`` (block
            one-hot: starts as concatenated heads of size D̃k/H), ``xavier`` (reference NMT code),
            ``ones`` (every head starts identical).
        qk_bias: q_proj/k_proj with biases and no content bias (the authors' fairseq fork).
        scaling: ``key_dim`` 1/sqrt(D̃k/H) (EPFL package) or ``head_dim`` 1/sqrt(d/H) (fork).
        proj_init: ``mha`` (fairseq MHA: xavier gain 1/sqrt(2) on q/k/v) or ``fork`` (gain
            1/sqrt(2) only when D̃k = kdim = vdim = d, plain xavier otherwise).
    """

    def __init__(self, embed_dim: int, num_heads: int, key_dim: int, dropout: float = 0.0,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 mixing_init: str = "random", bias: bool = True, qk_bias: bool = False,
                 scaling: str = "key_dim", proj_init: str = "mha",
                 rope_theta: Optional[float] = None):
        super().__init__(embed_dim, num_heads, dropout)
        # RoPE over the D̃k shared features, applied to each head's mixed query q diag(m_i) and to
        # the shared keys: (R_m q diag(m_i)) · (R_n k) = q diag(m_i) R_(n-m) k, relative again
        # (rotating q before the mixing would not be: diag(m_i) does not commute with R)
        self.rotary = None if rope_theta is None else RotaryEmbedding(key_dim, rope_theta)
        # user-facing checks (one line naming the flag) are the fairseq options' validate()
        assert key_dim > 0, f"key_dim (D̃k) {key_dim}"
        assert mixing_init in MIXING_INITS and scaling in SCALINGS and proj_init in PROJ_INITS, \
            (mixing_init, scaling, proj_init)
        kdim, vdim = kdim or embed_dim, vdim or embed_dim
        self.key_dim = key_dim
        self.mixing_init = mixing_init
        self.proj_init = proj_init
        self.q_proj = nn.Linear(embed_dim, key_dim, bias=qk_bias)  # W̃Q (+ b̃Q), shared by all heads
        self.k_proj = nn.Linear(kdim, key_dim, bias=qk_bias)  # W̃K (+ b̃K), shared by all heads
        self.mixing = nn.Parameter(torch.empty(num_heads, key_dim))  # M, row i = m_i
        # w_i: key-only logit term (with q/k biases it is b̃Q diag(m_i) W̃Kᵀ instead)
        self.content_bias = None if qk_bias else nn.Linear(kdim, num_heads, bias=False)
        self.v_proj = nn.Linear(vdim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        # applied to the bilinear term *and* the content bias
        self.scaling = ((key_dim if scaling == "key_dim" else embed_dim) / num_heads) ** -0.5
        self._same_dims = key_dim == embed_dim and kdim == embed_dim and vdim == embed_dim
        self.reset_parameters()

    def reset_parameters(self):
        init_like_fairseq_mha((self.q_proj, self.k_proj, self.v_proj), self.out_proj)
        if self.proj_init == "fork" and not self._same_dims:  # fairseq's rule for kdim != d
            for lin in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.xavier_uniform_(lin.weight)
        if self.content_bias is not None:
            self.content_bias.reset_parameters()  # nn.Linear default, as the reference
        with torch.no_grad():
            if self.mixing_init == "concatenate":
                self.mixing.copy_(concatenate_mixing(self.num_heads, self.key_dim))
            elif self.mixing_init == "random":
                self.mixing.normal_(0.0, 0.2)
            elif self.mixing_init == "xavier":
                nn.init.xavier_uniform_(self.mixing)
            else:
                self.mixing.fill_(1.0)

    # ---- attention ---------------------------------------------------------------------------
    def keys(self, x_kv: Optional[Tensor], ctx: AttnContext):
        """The keys and values [B, Tk, ·]: k̃ = Y W̃K (shared by all heads) and, with a content
        bias, k' = [Y W̃K | Y wᵀ | 0] (:meth:`_key_features`)."""
        make_k = self.k_proj if self.content_bias is None else self._key_features
        if ctx.static_kv:  # encoder output: computed once per sentence
            return (ctx.cache_static("k", lambda: make_k(x_kv)),
                    ctx.cache_static("v", lambda: self.v_proj(x_kv)))
        k = make_k(x_kv)
        if self.rotary is not None:  # at the keys' own positions, once, then cached
            k = self._rotated(k, ctx.offset)
        kv = ctx.cache(k=k, v=self.v_proj(x_kv))
        return kv["k"], kv["v"]

    def _rotated(self, x: Tensor, offset: int) -> Tensor:
        """RoPE on the first D̃k features of ``x [..., T, F]`` (the content-bias columns after
        them carry no position)."""
        d = self.key_dim
        if x.size(-1) == d:
            return self.rotary(x, offset)
        return torch.cat([self.rotary(x[..., :d], offset), x[..., d:]], -1)

    def _content_width(self) -> int:
        """The H content features and the zero columns after them, up to a multiple of 8 of the
        product's width (where the fused kernels run)."""
        return self.num_heads + (-(self.key_dim + self.num_heads) % 8)

    def _key_features(self, y: Tensor) -> Tensor:
        """k' = [Y W̃K | Y wᵀ | 0]: the shared keys, the content bias and the zero columns, one
        product of Y with the stacked weights (the two projections, their concatenation and the
        zero padding were four kernels forward and five backward)."""
        rows = [self.k_proj.weight, self.content_bias.weight]
        zeros = self._content_width() - self.num_heads
        if zeros:
            w = self.k_proj.weight
            rows.append(_zeros(zeros, w.size(1), w.dtype, w.device))
        return F.linear(y, torch.cat(rows))

    def compute(self, x_q: Tensor, x_kv: Optional[Tensor], ctx: AttnContext) -> Tensor:
        k, v = self.keys(x_kv, ctx)
        q, mixing = self.q_proj(x_q), self.mixing
        if self.content_bias is not None:
            # the content bias as H more features: q'_i = [q, 1] * [m_i, e_i] and k' = [k, c]
            # give q'_i k'ᵀ = q diag(m_i) kᵀ + 1 c_iᵀ, so it rides in the fused kernel's product
            # instead of a [B, H, Tq, Tk] additive bias whose gradient the kernel must write (and
            # the CPU has no fused kernel for); zero columns up to a multiple of 8, where the
            # fused kernels run (k' has them from _key_features)
            extra = self._content_width()
            q = F.pad(q, (0, extra), value=1.0)
            mixing = torch.cat([mixing, _content_mixing(self.num_heads, extra, mixing.dtype,
                                                        mixing.device)], -1)
        # q_i = X W̃Q diag(m_i): [B, 1, Tq, D̃k] * [1, H, 1, D̃k] -> [B, H, Tq, D̃k]
        q = q.unsqueeze(1) * mixing[None, :, None, :]
        if self.rotary is not None and not ctx.static_kv:
            q = self._rotated(q, ctx.offset)
        k = k.unsqueeze(1).expand(-1, self.num_heads, -1, -1)  # one key tensor for all heads
        out = ctx.attend(q, k, self.split_heads(v), scale=self.scaling)
        return self.out_proj(self.merge_heads(out))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the authors' fairseq fork names the mixing matrix ``mixing_matrix``
        if prefix + "mixing_matrix" in state_dict and prefix + "mixing" not in state_dict:
            state_dict[prefix + "mixing"] = state_dict.pop(prefix + "mixing_matrix")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- conversion --------------------------------------------------------------------------
    @classmethod
    def from_mha(cls, mha: nn.Module, key_dim: Optional[int] = None, n_iter_max: int = 50,
                 tol: float = 1e-5) -> "CollaborativeAttention":
        """Re-parametrise a trained concatenated-heads module with ``q_proj/k_proj/v_proj/out_proj``
        (fairseq ``MultiheadAttention`` or :class:`ZooMultiheadAttention`).

        ``key_dim`` None or H·d_k: the exact block construction (same outputs). Smaller: CP
        decomposition of the stacked products W_Q,i W_K,iᵀ (:func:`cp_heads`)."""
        state = mha.state_dict()
        wq, wk = state["q_proj.weight"], state["k_proj.weight"]
        factors = {}
        if key_dim is not None and key_dim != wq.size(0):
            A, B = head_projections(wq, wk, mha.num_heads)
            cp = cp_heads(A, B, key_dim, n_iter_max=n_iter_max, tol=tol)
            factors = dict(W_Q=cp.W_Q.to(wq), mixing=cp.mixing.to(wq), W_K=cp.W_K.to(wq))
        new_state = collab_state_from_mha(state, mha.num_heads, **factors)
        new = cls(mha.embed_dim, mha.num_heads, new_state["q_proj.weight"].size(0),
                  dropout=_dropout_p(mha), kdim=wk.size(1), vdim=state["v_proj.weight"].size(1),
                  mixing_init="concatenate", bias=state.get("v_proj.bias") is not None)
        new.load_state_dict(new_state)
        return new.to(wq.device)


def _dropout_p(mha: nn.Module) -> float:
    mod = getattr(mha, "dropout_module", None)  # fairseq MHA keeps p on a FairseqDropout
    return float(mod.p) if mod is not None else float(getattr(mha, "dropout", 0.0))


def collab_state_from_mha(state, num_heads: int, W_Q: Optional[Tensor] = None,
                          mixing: Optional[Tensor] = None, W_K: Optional[Tensor] = None):
    """Parameters of a :class:`CollaborativeAttention` from a concatenated MHA ``state_dict``.

    Concatenated head i computes (x_q W_Q,i + b_Q,i)(W_K,iᵀ x_k + b_K,i) / sqrt(d_k). Expanded:
    x_q W_Q,i W_K,iᵀ x_k  (bilinear: W̃Q diag(m_i) W̃Kᵀ)  +  b_Q,i W_K,iᵀ x_k  (content bias w_i)
    +  x_q W_Q,i b_K,i + b_Q,i b_K,i  (constant over keys: cancels in the softmax, so b_K is dropped).

    The collaborative layer divides by sqrt(D̃k/H) instead of sqrt(d_k): M and w are multiplied by
    sqrt(D̃k/H) / sqrt(d_k) (= 1 at full rank), so the logits equal the original's.
    ``W_Q [d, D̃k], mixing [H, D̃k], W_K [kdim, D̃k]``: factors with Σ_r W_Q[:, r] M[i, r] W_K[:, r]ᵀ
    ≈ W_Q,i W_K,iᵀ; None: the exact block construction (D̃k = H·d_k, block one-hot M).
    """
    wq, wk = state["q_proj.weight"], state["k_proj.weight"]  # [H·dk, d], [H·dk, kdim]
    head_dim = wq.size(0) // num_heads
    if W_Q is None:
        W_Q, W_K = wq.t(), wk.t()
        mixing = concatenate_mixing(num_heads, wq.size(0)).to(wq)
    key_dim = W_Q.size(1)
    fix = math.sqrt(key_dim / num_heads) / math.sqrt(head_dim)
    bq = state.get("q_proj.bias")
    if bq is None:
        w = torch.zeros(num_heads, wk.size(1), dtype=wk.dtype)
    else:  # w_i = b_Q,i W_K,iᵀ, as a row acting on x_k
        w = torch.einsum("hd,hdk->hk", bq.view(num_heads, head_dim),
                         wk.view(num_heads, head_dim, wk.size(1)))
    out = {
        "q_proj.weight": W_Q.t().contiguous(),
        "k_proj.weight": W_K.t().contiguous(),
        "mixing": (mixing * fix).contiguous(),
        "content_bias.weight": (w * fix).contiguous(),
        "v_proj.weight": state["v_proj.weight"],
        "out_proj.weight": state["out_proj.weight"],
    }
    for name in ("v_proj.bias", "out_proj.bias"):
        if state.get(name) is not None:
            out[name] = state[name]
    return out


# ---- re-parametrisation of trained heads: CP decomposition of the stacked W_Q,i W_K,iᵀ -------------

def head_projections(wq: Tensor, wk: Tensor, num_heads: int):
    """nn.Linear weights [H·d_k, d] -> per-head W_Q,i [H, d, d_k] and W_K,i [H, kdim, d_k]."""
    head_dim = wq.size(0) // num_heads
    A = wq.view(num_heads, head_dim, wq.size(1)).transpose(1, 2)
    B = wk.view(num_heads, head_dim, wk.size(1)).transpose(1, 2)
    return A, B


class CPHeads(NamedTuple):
    """T_i = W_Q,i W_K,iᵀ ≈ W_Q diag(m_i) W_Kᵀ for every head i."""

    W_Q: Tensor  # [d, D̃k]
    mixing: Tensor  # [H, D̃k]
    W_K: Tensor  # [kdim, D̃k]
    rel_error: float  # ||T - T̂||_F / ||T||_F over the stacked [H, d, kdim] tensor
    iterations: int


def cp_init_heads(A: Tensor, B: Tensor, rank: int):
    """Start point for CP: the ``rank`` largest singular triplets over all heads' T_i = A_i B_iᵀ
    (each component used by one head only). Its error is the best any per-head truncation reaches;
    ALS then lets heads share components. Returns (M [H, R], W_Q [d, R], W_K [kdim, R])."""
    H, d, dk = A.shape
    if rank > H * dk:
        raise ValueError(f"rank {rank} exceeds the key dimension H·d_k = {H * dk}")
    Qa, Ra = torch.linalg.qr(A)  # T_i = Qa (Ra Rbᵀ) Qbᵀ: SVD of a small d_k x d_k core per head
    Qb, Rb = torch.linalg.qr(B)
    U, S, Vh = torch.linalg.svd(Ra @ Rb.transpose(1, 2))
    u, v = Qa @ U, Qb @ Vh.transpose(1, 2)  # [H, d, d_k], [H, kdim, d_k]
    order = torch.argsort(S.reshape(-1), descending=True, stable=True)[:rank]
    head, j = order // dk, order % dk
    mixing = torch.zeros(H, rank, dtype=A.dtype)
    mixing[head, torch.arange(rank)] = S.reshape(-1)[order]
    return mixing, u[head, :, j].t().contiguous(), v[head, :, j].t().contiguous()


def cp_heads(A: Tensor, B: Tensor, rank: int, n_iter_max: int = 50, tol: float = 1e-5,
             init=None) -> CPHeads:
    """Rank-``rank`` CP decomposition of T [H, d, kdim], T_i = A_i B_iᵀ, by alternating least
    squares: the same updates as ``tensorly.decomposition.parafac`` (modes in the order M, W̃Q,
    W̃K), but every MTTKRP is computed from the per-head factors, so neither the dense tensor nor a
    Khatri-Rao product is formed: four [H, d, d_k] x [d_k, R] products per sweep, O(H·d·d_k·R),
    instead of O(H·d·kdim·R). Stops after ``n_iter_max`` sweeps or when the relative error
    improves by less than ``tol``. Computes in float64."""
    A, B = A.double(), B.double()
    At, Bt = A.transpose(1, 2), B.transpose(1, 2)  # [H, d_k, d], [H, d_k, kdim]
    norm2 = float(((At @ A) * (Bt @ B)).sum())  # ||T||² = Σ_i tr(A_iᵀA_i B_iᵀB_i)
    M, P, C = (cp_init_heads(A, B, rank) if init is None else [f.double().clone() for f in init])
    eye = torch.eye(rank, dtype=torch.float64)

    def solve(gram, mttkrp):  # least squares X gram = mttkrp (gram is symmetric PSD)
        ridge = 1e-12 * float(gram.diagonal().mean().clamp(min=1e-300))
        return torch.linalg.solve(gram + ridge * eye, mttkrp.t()).t()

    def rel_error(PA, CB):  # ||T - T̂||² = ||T||² - 2<T, T̂> + ||T̂||², from small matrices only
        inner = (M * (PA * CB).sum(1)).sum()  # <T, T̂> = Σ_{i,r} M[i,r] (p_rᵀ A_i)·(c_rᵀ B_i)
        est = ((M.t() @ M) * (P.t() @ P) * (C.t() @ C)).sum()
        return math.sqrt(max(float(norm2 - 2 * inner + est), 0.0) / max(norm2, 1e-300))

    PA, CB = torch.matmul(At, P), torch.matmul(Bt, C)  # A_iᵀ p_r, B_iᵀ c_r: [H, d_k, R]
    err = rel_error(PA, CB)
    it = 0
    for it in range(1, n_iter_max + 1):
        # mode H: MTTKRP[i, r] = (A_iᵀ p_r)·(B_iᵀ c_r)
        M = solve((P.t() @ P) * (C.t() @ C), (PA * CB).sum(1))
        # mode d: MTTKRP[:, r] = Σ_i M[i, r] A_i (B_iᵀ c_r)
        P = solve((M.t() @ M) * (C.t() @ C), torch.matmul(A, CB * M[:, None, :]).sum(0))
        PA = torch.matmul(At, P)
        # mode kdim: MTTKRP[:, r] = Σ_i M[i, r] B_i (A_iᵀ p_r)
        C = solve((M.t() @ M) * (P.t() @ P), torch.matmul(B, PA * M[:, None, :]).sum(0))
        CB = torch.matmul(Bt, C)
        new = rel_error(PA, CB)
        done = err - new < tol
        err = new
        if done:
            break
    M, P, C = balance_cp(M, P, C, A, B)
    return CPHeads(P, M, C, err, it)


def balance_cp(M: Tensor, P: Tensor, C: Tensor, A: Tensor, B: Tensor):
    """Rescale every component so that W̃Q and W̃K columns have the mean column norm of the
    original W_Q / W_K and the mixing carries the rest (one-hot-like magnitudes, as at full rank);
    the product, i.e. the attention logits, is unchanged."""
    p, c = P.norm(dim=0).clamp(min=1e-30), C.norm(dim=0).clamp(min=1e-30)
    a0, b0 = A.norm(dim=1).mean(), B.norm(dim=1).mean()
    return M * (p * c / (a0 * b0)), P * (a0 / p), C * (b0 / c)
