"""Synthesizer self-attention (Tay et al. 2020, "Synthesizer: Rethinking Self-Attention in
Transformer Models", https://arxiv.org/abs/2005.00743).

The attention logits are *synthesized* instead of computed from query-key dot products:

* Dense:             B = ReLU(X W1 + b1) W2 + b2      (per token, to N = max_len columns)
* Random:            B = R                            (trainable R [h, N, N]; Fixed Random: frozen)
* Factorized Dense:  B = H_A(A) * H_B(B'),  A = F_A(X) [n, a],  B' = F_B(X) [n, b],  a*b >= N
* Factorized Random: B = R1 R2^T                      (R1, R2 [h, N, k], rank k)
* Vanilla:           B = Q K^T / sqrt(d_k)           (the ordinary dot product, for mixtures)

and Y = Softmax(B) G(X) with G the value projection (then the usual output projection).
Mixtures use Softmax(sum_i alpha_i S_i(X)) with alpha = softmax(per-component scalars): the
weights sum to 1 and are learned, one set per layer.

Tables indexed by position (R, R1, R2, the columns of W2) are indexed by *pad-aware* positions
(``ctx.query_positions() / key_positions()``), so a left-padded sentence gets exactly the logits
of its unpadded copy; with no padding the tables are sliced [:Lq, :Lk] instead of gathered.
With the ``sdpa`` table kernel (``TABLE_KERNELS``; the default on CUDA) Random's R[i, j] = R[i]·e_j
runs through the fused kernel as a dot product of the query's row of R and the key's one-hot
position while the keys are at most ``RANDOM_DOT_MAX_WIDTH`` long, and Factorized Random's
R1[i]·R2[j] with a per-sentence mask; otherwise they are tables, and a table with no
per-sentence mask gets one Softmax for the whole batch.

Incremental decoding caches only G(x) (and the keys for +vanilla mixtures): step t uses row t of R
(or the row synthesized from the current token for Dense) over columns 0..t.

The module in parts, each read on its own: :class:`SynthesizerParameters` (what the components
learn, and their init), :class:`SynthesizerTerms` (the logits S_i(X), one method per component,
where they are read in the position tables: :class:`TermPositions`; Random as a dot product:
:func:`random_dot`), :class:`SynthesizerAttention` (the values and the decoding cache, the
length check, Softmax(B) G(X) through the fused kernel or with the logits materialized).

Imports torch and ``.base`` only.
"""

import math
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import AttnContext, ZooAttention
from .constants import cached_constant
from .precision import fp32_softmax
from .rotary import RotaryEmbedding

#: the logit synthesizers; several of them make a mixture
COMPONENTS = ("dense", "random", "factorized_dense", "factorized_random", "vanilla")


def check_components(components) -> None:
    """One line for a ``components`` that is not one or more distinct names of
    :data:`COMPONENTS` (a misspelled name gets the closest one)."""
    import difflib

    unknown = [c for c in components if c not in COMPONENTS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), COMPONENTS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"SynthesizerAttention components {tuple(components)!r}: "
                         f"{unknown[0]!r} is not a component: {hint}pass one or more of "
                         f"{', '.join(COMPONENTS)}")
    if not components or len(set(components)) != len(components):
        raise ValueError(f"SynthesizerAttention components {tuple(components)!r}: pass one or more "
                         f"of {', '.join(COMPONENTS)}, each once")


def default_factors(max_len: int):
    """Factorized Dense sizes (a, b) with a*b >= max_len: the most balanced exact factorization
    (16 x 16 for 256, 16 x 8 for 128), or ceil(sqrt(N)) squared when N has no balanced divisor."""
    b = int(math.isqrt(max_len))
    while b > 1 and max_len % b:
        b -= 1
    if b * b * 4 >= max_len:  # balanced enough (b >= sqrt(N)/2)
        return max_len // b, b
    a = math.isqrt(max_len - 1) + 1
    return a, a


def factorized_dense_sizes(max_len: int, factor_a: Optional[int] = None,
                           factor_b: Optional[int] = None):
    """Factorized Dense (a, b): both given, one given and the other ceil(N / given), or
    :func:`default_factors`. The caller checks a*b >= N."""
    if factor_a and factor_b:
        return factor_a, factor_b
    if factor_a:
        return factor_a, -(-max_len // factor_a)
    if factor_b:
        return -(-max_len // factor_b), factor_b
    return default_factors(max_len)


@cached_constant
def _constant(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-dim tensor holding ``value`` (a fill kernel per layer otherwise); only expanded."""
    return torch.full((), value, dtype=dtype, device=device)


#: how Random and Factorized Random logits run (``table_kernel``): ``sdpa`` = as dot products
#: through the fused kernel (Random: rows of R against one-hot key positions; Factorized Random:
#: R1 rows against R2 rows) wherever that is exact and not wider than the table; ``table`` = the
#: logits materialized, with one softmax for the batch when it shares one map; ``auto`` = ``sdpa``
#: on the devices in :data:`AUTO_SDPA_DEVICES`, ``table`` elsewhere
TABLE_KERNELS = ("auto", "sdpa", "table")
#: where ``auto`` picks ``sdpa``: on CUDA a training step waits for the host, and the fused
#: kernel takes 14 fewer kernel launches per layer and step than the table (Random, padded); on
#: the CPU it costs 0.9-5x the table's time (docs/synthesizer.md, "Speed")
AUTO_SDPA_DEVICES = {"cuda"}
#: the widest one-hot key (the key length rounded up to 8) with which Random runs as a dot
#: product in the fused kernel; past it (and past the head width) the logits are a table, as
#: the product over c features would cost the kernel more than c/d_h times the values' work
RANDOM_DOT_MAX_WIDTH = 128


@cached_constant
def _identity(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``eye(rows, cols)``: the one-hot vectors of positions 0..rows-1."""
    return torch.eye(rows, cols, dtype=dtype, device=device)


def _select_positions(table: Tensor, index: Tensor) -> Tensor:
    """``table[:, index]`` moved batch-first: [h, M, *rest] and index [B, *S] -> [B, h, *S, *rest]
    (a view of an [h, B, *S, *rest] tensor). Through ``index_select``, whose backward is an
    ``index_add_``; advanced indexing's backward is a sorted ``index_put_``, the largest kernel of
    a transformer-base step on an H100 (CHANGELOG; benchmark case ``synthesizer/pad-aware-gather``)."""
    out = table.index_select(1, index.reshape(-1))
    return out.view(table.shape[:1] + index.shape + table.shape[2:]).transpose(0, 1)


class SequenceTooLong(ValueError):
    """A sequence longer than the synthesized tables: ``length`` positions, ``max_len`` rows (a
    host words the fix in its own terms: the fairseq sublayer names its flags)."""

    def __init__(self, length: int, max_len: int):
        self.length, self.max_len = length, max_len
        super().__init__(
            f"sequence length {length} (the first dimension of time-first [T, B, C] inputs) "
            f"exceeds the synthesizer max length {max_len}: build SynthesizerAttention with "
            f"max_len >= {length}, or pass at most {max_len} positions")


class TermPositions(NamedTuple):
    """Where one forward pass's terms are read in the position tables, and how they run."""

    tq: int  # queries of this step
    offset: int  # positions decoded before them (incremental decoding)
    qpos: Optional[Tensor]  # pad-aware positions [B, Tq] of the queries; None: no padding
    kpos: Optional[Tensor]  # ... of the keys [B, Tk]; None: 0..Tk-1
    k_len: int  # Tk
    cols: int  # columns of the tables in use: min(Tk, N)
    shared: bool  # the table terms are one map for the whole batch
    fused: bool  # the sdpa table kernel: Random / Factorized Random as dot products


def _by_position(table: Tensor, pos: Optional[Tensor], start: int, length: int) -> Tensor:
    """Rows of a position table [h, N, ...] for positions ``pos`` [B, T] (gathered) or, with no
    padding, ``start .. start+length-1`` (sliced): -> [B or 1, h, T, ...]."""
    if pos is None:
        return table[:, start:start + length].unsqueeze(0)
    return _select_positions(table, pos)


# ---- Random as a dot product (the sdpa table kernel) ---------------------------------------------
def random_dot_width(R: Tensor, cols: int, head_dim: int) -> Optional[int]:
    """The width c of Random's dot form for keys at ``cols`` positions (they must cover every key
    position; at least the head width, so that q, k and v share one width and the kernel needs no
    padding copies), or None when that is wider than :data:`RANDOM_DOT_MAX_WIDTH` and the head:
    there the product over c features costs more than the table's logits."""
    c = -(-cols // 8) * 8
    if c > max(RANDOM_DOT_MAX_WIDTH, head_dim):
        return None
    return min(R.size(2), max(c, head_dim))


def random_dot(R: Tensor, ctx: AttnContext, at: TermPositions, c: int, num_heads: int):
    """Random's R[qpos, kpos] as a dot product, for the fused kernel: the query's row of R (its
    first c columns) against the one-hot vector of the key's position. Exact in any precision
    (one non-zero product per logit), and the only per-sentence tensor is the gathered rows: no
    [B, H, Tq, Tk] logits and fp32 softmax, forward or backward (columns past the keys meet zeros
    in the one-hot vectors and get no gradient). Returns q ``[B or 1, h, Tq, c]`` and k
    ``[B or 1, H or 1, Tk, c]`` (with padding, made once per forward for all layers)."""
    n = R.size(2)
    dtype, device = R.dtype, R.device
    qpos, kpos, tq, k_len = at.qpos, at.kpos, at.tq, at.k_len
    if qpos is None:  # no padding: rows off.., keys 0..Tk-1
        return (R[:, at.offset:at.offset + tq, :c].unsqueeze(0),
                _identity(k_len, c, dtype, device).view(1, 1, k_len, c))
    # one gather of the rows' first c entries of the flattened table (its backward is one
    # index_add into R's gradient), by ids made once per forward
    ids = ctx.from_masks(("synthesizer rows", n, tq, c),
                         lambda: qpos[:, :, None] * n + torch.arange(c, device=device))
    rows = _select_positions(R.flatten(1, 2), ids)
    onehot = ctx.from_masks(
        ("synthesizer one-hot", k_len, c, num_heads, dtype, str(device)),
        # (a scatter: F.one_hot reads the positions' range back to the host)
        lambda: torch.zeros(kpos.size(0), 1, k_len, c, dtype=dtype, device=device).scatter_(
            -1, kpos[:, None, :, None], 1.0).expand(-1, num_heads, -1, -1).contiguous())
    return rows, onehot


class SynthesizerParameters:
    """What the synthesized components learn: Dense's W1, W2, b2, Factorized Dense's F_A, F_B,
    the Random tables R (R1, R2 for Factorized Random; buffers when frozen), the mixture's alpha
    logits; :meth:`_init_components` makes them, :meth:`reset_components` initialises them. A part
    of :class:`SynthesizerAttention`: the parameters live on that module, under the names its
    checkpoints have always had."""

    def _init_components(self, components: Tuple[str, ...], max_len: int, freeze_random: bool,
                         factor_a: Optional[int], factor_b: Optional[int], rank: int,
                         share_heads: bool):
        self.freeze_random = freeze_random
        self.share_heads = share_heads
        H, dh, d, N = self.num_heads, self.head_dim, self.embed_dim, max_len
        hr = 1 if share_heads else H  # heads of the Random tables
        if "dense" in components:
            self.dense_W1 = nn.Linear(d, d)  # W1, b1 (hidden split per head)
            # per-head W2: d_h -> N, stored one d_h-vector per column (position) j: [H, N, d_h]
            self.dense_W2 = nn.Parameter(torch.empty(H, N, dh))
            self.dense_b2 = nn.Parameter(torch.zeros(H, N))
        if "factorized_dense" in components:
            a, b = factorized_dense_sizes(N, factor_a, factor_b)
            assert a * b >= N, f"factor_a {a} x factor_b {b} < max_len {N}"
            self.factor_a, self.factor_b = a, b
            self.fdense_W1 = nn.Linear(d, d)
            self.fdense_WA = nn.Parameter(torch.empty(H, dh, a))  # F_A: n x a
            self.fdense_bA = nn.Parameter(torch.zeros(H, a))
            self.fdense_WB = nn.Parameter(torch.empty(H, dh, b))  # F_B: n x b
            self.fdense_bB = nn.Parameter(torch.zeros(H, b))
        if "random" in components:
            self._table("R", torch.empty(hr, N, N))
        if "factorized_random" in components:
            self.rank = rank
            self._table("R1", torch.empty(hr, N, rank))
            self._table("R2", torch.empty(hr, N, rank))
        if len(components) > 1:
            # alpha = softmax(mix_logits): one weight per component, sum 1, equal at init
            self.mix_logits = nn.Parameter(torch.zeros(len(components)))

    def _table(self, name: str, t: Tensor):
        if self.freeze_random:  # Fixed Random: in the state dict, never in the optimizer
            self.register_buffer(name, t)
        else:
            setattr(self, name, nn.Parameter(t))

    @torch.no_grad()
    def reset_components(self):
        for name in ("dense_W1", "fdense_W1"):
            if hasattr(self, name):
                nn.init.xavier_uniform_(getattr(self, name).weight)
                nn.init.zeros_(getattr(self, name).bias)
        for name in ("dense_W2", "fdense_WA", "fdense_WB"):
            if hasattr(self, name):
                for w in getattr(self, name):  # per head [d_h, cols]
                    nn.init.xavier_uniform_(w)
        if hasattr(self, "R"):
            for r in self.R:  # per head [N, N]: small logits, near-uniform attention at init
                nn.init.xavier_uniform_(r)
        if hasattr(self, "R1"):
            # entries of R1 R2^T get variance k*s^4 = 1/N, like xavier on an [N, N] table
            std = (self.rank * self.max_len) ** -0.25
            nn.init.normal_(self.R1, std=std)
            nn.init.normal_(self.R2, std=std)

    def mixture_weights(self) -> Dict[str, float]:
        """alpha per component (sums to 1); {component: 1.0} for a pure mode."""
        if len(self.components) == 1:
            return {self.components[0]: 1.0}
        alpha = torch.softmax(self.mix_logits.detach().float(), dim=0)
        return {c: float(a) for c, a in zip(self.components, alpha)}


class SynthesizerTerms(SynthesizerParameters):
    """The synthesized logits S_i(X), one method per component of :data:`COMPONENTS`, each already
    weighted by its mixture weight alpha_i (a part of :class:`SynthesizerAttention`).

    A term is returned in one of two forms:

    * a dot-product term S_i = q_i k_i^T as lists of feature blocks ``([q blocks], [k blocks])``
      (Dense, Vanilla; with the sdpa table kernel Random while its keys are narrow, Factorized
      Random unless the batch shares one map): they go through the fused SDPA kernel, all blocks
      concatenated along the feature dimension in one copy;
    * a table ``[B or 1, H or 1, Tq, Tk]`` (Factorized Dense; Random and Factorized Random
      otherwise), added to the logits.
    """

    def terms(self, x_q: Tensor, k: Optional[Tensor], ctx: AttnContext, k_len: int):
        """The components' terms, each weighted by its alpha: ``(dots, tables)`` (see the class)."""
        at = self._positions(x_q, ctx, k_len)
        alpha = None
        if len(self.components) > 1:
            alpha = torch.softmax(self.mix_logits.float(), dim=0).to(x_q.dtype)
        dots, tables = [], []
        for i, name in enumerate(self.components):
            term = getattr(self, f"_{name}_term")(x_q, k, ctx, at,
                                                   None if alpha is None else alpha[i])
            (dots if isinstance(term, tuple) else tables).append(term)
        return dots, tables

    def synthesized_logits(self, x_q: Tensor, k: Optional[Tensor], ctx: AttnContext,
                           k_len: int) -> Tensor:
        """Sum_i alpha_i S_i(X) before masking: [B or 1, H or 1, Tq, Tk]."""
        return self._sum_terms(*self.terms(x_q, k, ctx, k_len))

    @staticmethod
    def _sum_terms(dots, tables) -> Tensor:
        """sum_i q_i k_i^T + sum_j table_j (each already weighted by its alpha)."""
        logits = None
        cat = lambda blocks: blocks[0] if len(blocks) == 1 else torch.cat(blocks, -1)
        products = [torch.matmul(cat(q), cat(kk).transpose(-1, -2)) for q, kk in dots]
        for term in products + list(tables):
            logits = term if logits is None else logits + term
        return logits

    # ---- positions ---------------------------------------------------------------------------------
    def _positions(self, x_q: Tensor, ctx: AttnContext, k_len: int) -> TermPositions:
        tq = x_q.size(1)
        if ctx.key_padding_mask is None:  # fast path: positions are 0..Tk-1, slice the tables
            qpos = kpos = None
        else:  # pad-aware positions: gather rows/columns by each token's real position
            kpos = ctx.key_positions(k_len, x_q.device).expand(x_q.size(0), k_len)
            qpos = kpos[:, -tq:]
        # with no padding and no weight dropout the table terms are one map for the whole batch
        # (the attention's shared path); otherwise, with the sdpa kernel, Factorized Random's
        # R1 R2ᵀ, a dot product of rank k, is better a dot term: the fused kernel, no
        # [B, H, Tq, Tk] logits or fp32 softmax. So is Random's R[i, j] = R[i]·e_j, padded or
        # not, while its width (the keys') is small
        shared = qpos is None and not (self.training and self.dropout > 0)
        fused = self.table_kernel == "sdpa" or (self.table_kernel == "auto" and
                                                x_q.device.type in AUTO_SDPA_DEVICES)
        return TermPositions(tq, ctx.offset, qpos, kpos, k_len, min(k_len, self.max_len), shared,
                             fused)

    def _hidden(self, x: Tensor, W1: nn.Linear) -> Tensor:
        """ReLU(X W1 + b1), split per head: [B, T, C] -> [B, H, T, d_h]."""
        return self.split_heads(F.relu(W1(x)))

    # ---- the components (x_q [B, Tq, C]; k: the vanilla keys; w: alpha_i, None for one) ----------
    def _dense_term(self, x_q, k, ctx, at: TermPositions, w):
        """B = ReLU(X W1 + b1) W2 + b2: row t from token t; column j is W2's j-th d_h-vector
        (and b2_j), so b2 rides along as a constant-1 query feature."""
        q = self._hidden(x_q, self.dense_W1)
        one = (_constant(1.0, q.dtype, q.device) if w is None else w.to(q.dtype))
        one = one.expand(q.shape[:-1] + (1,))
        kk = [_by_position(self.dense_W2, at.kpos, 0, at.k_len),
              _by_position(self.dense_b2.unsqueeze(-1), at.kpos, 0, at.k_len)]
        return [q if w is None else q * w, one], kk

    def _vanilla_term(self, x_q, k, ctx, at: TermPositions, w):
        """Q K^T / sqrt(d_k), alpha folded into the one scaling."""
        scale = self.head_dim ** -0.5
        q = self.split_heads(self.q_proj(x_q))
        if self.rotary is not None:
            q = self.rotary(q, ctx.offset)
        return [q * (scale if w is None else w * scale)], [k]

    def _random_term(self, x_q, k, ctx, at: TermPositions, w):
        """R[qpos, kpos]: a dot product R[qpos] . onehot(kpos) while the keys are narrow (sdpa
        table kernel), else the table."""
        width = random_dot_width(self.R, at.cols, self.head_dim) if at.fused else None
        if width:
            rows, onehot = random_dot(self.R, ctx, at, width, self.num_heads)
            return [rows if w is None else rows * w], [onehot]
        if at.qpos is None:
            t = self.R[:, at.offset:at.offset + at.tq, :at.k_len].unsqueeze(0)
        else:  # one gather of (row, column) pairs of the flattened table
            n = self.R.size(2)  # the same (row, column) ids in every layer
            qpos, kpos = at.qpos, at.kpos
            pairs = ctx.from_masks(("synthesizer pairs", n, at.tq, at.k_len),
                                   lambda: qpos[:, :, None] * n + kpos[:, None, :])
            t = _select_positions(self.R.flatten(1, 2), pairs)
        return t if w is None else t * w

    def _factorized_random_term(self, x_q, k, ctx, at: TermPositions, w):
        """R1[qpos] R2[kpos]^T: a dot term with the sdpa table kernel unless the batch shares
        one map, else the table."""
        r1 = _by_position(self.R1, at.qpos, at.offset, at.tq)
        r2 = _by_position(self.R2, at.kpos, 0, at.k_len)
        if at.fused and not at.shared:
            return [r1 if w is None else r1 * w], [r2]
        t = torch.matmul(r1, r2.transpose(-1, -2))
        return t if w is None else t * w

    def _factorized_dense_term(self, x_q, k, ctx, at: TermPositions, w):
        """Column j = q*a + p of the outer product gets A[p] * B[q], A = F_A(X), B = F_B(X);
        only the Tk columns in use are made, not all a*b."""
        hid = self._hidden(x_q, self.fdense_W1)
        A = torch.matmul(hid, self.fdense_WA) + self.fdense_bA[:, None]
        Bf = torch.matmul(hid, self.fdense_WB) + self.fdense_bB[:, None]
        a = self.factor_a
        if at.kpos is None:
            j = torch.arange(at.cols, device=x_q.device)
            t = Bf[..., j // a] * A[..., j % a]
        else:
            j = at.kpos[:, None, None, :].expand(A.shape[:-1] + (at.k_len,))
            t = Bf.gather(-1, j // a) * A.gather(-1, j % a)
        return t if w is None else t * w


class SynthesizerAttention(SynthesizerTerms, ZooAttention):
    """Multi-head synthetic self-attention, time-first [T, B, C]; ``components``: mode or mixture.

    Self-attention only: the weights come from the query alone, so ``key`` and ``value`` are
    None or equal to ``query`` (``attn(x, x, x)``, as ``nn.MultiheadAttention`` is called);
    others are refused (:attr:`ZooAttention.self_attention_only`). A sequence longer than
    ``max_len`` raises :class:`SequenceTooLong`.

    The logits are :class:`SynthesizerTerms`; here: the values G(X) and the vanilla keys, cached
    for incremental decoding (:meth:`_new_values_keys`), the length check, and Softmax(B) G(X)
    (:meth:`_attend_dots` through the fused kernel, :meth:`_attend_tables` with an fp32 softmax).

    Args:
        embed_dim, num_heads, dropout: as fairseq's MultiheadAttention (dropout on the weights).
        components: subset of :data:`COMPONENTS` (one = pure mode, several = mixture).
        max_len: N, the largest sequence length (rows/columns of the synthesized tables).
        freeze_random: Fixed Random: R (and R1, R2) are buffers, kept in the state dict but never
            trained.
        factor_a, factor_b: Factorized Dense sizes a, b (a*b >= N); default :func:`default_factors`.
        rank: Factorized Random rank k.
        share_heads: one Random table for all heads instead of one per head.
        table_kernel: how Random and Factorized Random run, one of :data:`TABLE_KERNELS`.
    """

    self_attention_only = True

    def __init__(self, embed_dim: int, num_heads: int, components: Sequence[str] = ("random",),
                 max_len: int = 256, dropout: float = 0.0, freeze_random: bool = False,
                 factor_a: Optional[int] = None, factor_b: Optional[int] = None, rank: int = 32,
                 share_heads: bool = False, bias: bool = True, table_kernel: str = "auto",
                 rope_theta: Optional[float] = None):
        super().__init__(embed_dim, num_heads, dropout)
        components = tuple(components)
        if rope_theta is not None and "vanilla" not in components:
            raise ValueError(f"rotary positions need a q.k product: the Synthesizer "
                             f"{'+'.join(components)} has none (its tables are its positions); "
                             "pass rope_theta=None or add 'vanilla' to components")
        # RoPE on the vanilla component's Q and K only: the synthesized tables stay absolute
        self.rotary = None if rope_theta is None else RotaryEmbedding(embed_dim // num_heads,
                                                                      rope_theta)
        if table_kernel not in TABLE_KERNELS:
            raise ValueError(f"SynthesizerAttention table_kernel {table_kernel!r}: pass one of "
                             f"{', '.join(TABLE_KERNELS)}")
        self.table_kernel = table_kernel
        # (the fairseq options' validate() words the same checks as flags)
        check_components(components)
        if max_len < 1 or rank < 1:
            raise ValueError(f"SynthesizerAttention max_len {max_len} and rank {rank}: both must "
                             "be at least 1")
        self.components = components
        self.max_len = max_len
        d = embed_dim
        self.v_proj = nn.Linear(d, d, bias=bias)  # G(X)
        self.out_proj = nn.Linear(d, d, bias=bias)
        if "vanilla" in components:
            self.q_proj = nn.Linear(d, d, bias=bias)
            self.k_proj = nn.Linear(d, d, bias=bias)
        self._init_components(components, max_len, freeze_random, factor_a, factor_b, rank,
                              share_heads)
        #: set True to keep the last attention weights (``last_attention``) for analysis
        self.keep_attention = False
        self.last_attention: Optional[Tensor] = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        gain = 1 / math.sqrt(2)  # fairseq MHA's init for the input projections
        for name in ("q_proj", "k_proj", "v_proj"):
            if hasattr(self, name):
                nn.init.xavier_uniform_(getattr(self, name).weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)
        self.reset_components()

    # ---- incremental state and length ------------------------------------------------------------
    def _new_values_keys(self, x_q: Tensor, ctx: AttnContext):
        """G(X) and, with a vanilla component, its keys (rotated at their own positions, once)
        for the new positions, appended to the decoding cache: all of them so far ``[B, Tk, C]``
        (keys None without vanilla); extends the padding mask."""
        new = {"v": self.v_proj(x_q)}
        if "vanilla" in self.components:
            new["k"] = self.k_proj(x_q)
            if self.rotary is not None:
                new["k"] = self.rotary(new["k"].unflatten(-1, (self.num_heads, -1)), ctx.offset,
                                       seq_dim=-3).flatten(-2)
        full = ctx.cache(**new)  # incremental: all values so far
        return full["v"], full.get("k")

    def _check_length(self, k_len: int, ctx: AttnContext):
        """At most N real keys (left padding past N is fine: the tables are read by position)."""
        if k_len <= self.max_len:
            return
        pad = ctx.key_padding_mask
        real = k_len if pad is None else int((~pad).sum(1).max())
        if real > self.max_len:
            raise SequenceTooLong(real, self.max_len)

    # ---- attention -----------------------------------------------------------------------------
    def compute(self, x_q: Tensor, x_kv: Optional[Tensor], ctx: AttnContext) -> Tensor:
        v, k = self._new_values_keys(x_q, ctx)
        self._check_length(v.size(1), ctx)
        dots, tables = self.terms(x_q, None if k is None else self.split_heads(k), ctx, v.size(1))
        if dots and not tables and not self.keep_attention:
            out = self._attend_dots(dots, self.split_heads(v), ctx)
            return self.out_proj(self.merge_heads(out))
        return self.out_proj(self._attend_tables(dots, tables, v, ctx, x_q.size(1)))

    def _attend_tables(self, dots, tables, v: Tensor, ctx: AttnContext, tq: int) -> Tensor:
        """Softmax(sum of the terms + mask) G(X), the logits materialized (fp32 softmax): one
        softmax and one product per head for the batch when it shares one map. ``v [B, Tk, C]``;
        returns ``[B, Tq, C]``."""
        bsz, tk, d = v.shape
        logits = ctx.masked(self._sum_terms(dots, tables))
        dropout = self.dropout if self.training else 0.0
        shared = logits.size(0) == 1 and dropout == 0.0
        if not shared:
            logits = logits.expand(bsz, self.num_heads, tq, tk)
        probs = fp32_softmax(logits)
        if self.keep_attention:
            self.last_attention = probs.detach().expand(bsz, self.num_heads, tq, tk)
        if shared:
            # the same weights for every sentence (Random / Factorized Random, no padding):
            # Softmax(R) once, then one [Tq, Tk] x [Tk, B*d_h] product per head
            h = probs.size(1)
            vh = v.view(bsz, tk, h, d // h).permute(2, 1, 0, 3).reshape(h, tk, bsz * (d // h))
            out = torch.matmul(probs[0], vh)  # [h, Tq, B*d/h]
            return out.view(h, tq, bsz, d // h).permute(2, 1, 0, 3).reshape(bsz, tq, d)
        probs = F.dropout(probs, p=dropout, training=self.training)
        return self.merge_heads(torch.matmul(probs, self.split_heads(v)))

    def _attend_dots(self, dots, v: Tensor, ctx: AttnContext) -> Tensor:
        """Softmax(sum_i q_i k_i^T + mask) V with the fused kernel: the blocks of all terms are
        concatenated along the feature dimension, with the zero padding to one width for q, k, v
        (a multiple of 8, so the fast kernel applies) in the same copy."""
        bsz, h, tq, tk = v.size(0), v.size(1), dots[0][0][0].size(2), v.size(2)
        qs = [t for q, _ in dots for t in q]
        ks = [t for _, kk in dots for t in kk]
        dqk = sum(t.size(-1) for t in qs)
        width = -(-max(dqk, v.size(-1)) // 8) * 8
        if dqk != width:
            qs, ks = ([*t, _constant(0.0, t[0].dtype, t[0].device).expand(1, 1, 1, width - dqk)]
                      for t in (qs, ks))
        q, k = _one_tensor(qs, (bsz, h, tq)), _one_tensor(ks, (bsz, h, tk))
        dv = v.size(-1)
        if dv != width:
            v = F.pad(v, (0, width - dv))
        return ctx.attend(q, k, v, scale=1.0)[..., :dv]


def _one_tensor(blocks, lead) -> Tensor:
    """Feature blocks ``[.., T, d_i]`` (broadcastable to ``lead``) as one ``[*lead, sum d_i]``
    tensor: one concatenating copy, none for a single block that already has the shape."""
    if len(blocks) == 1 and blocks[0].shape[:-1] == lead:
        return blocks[0]
    return torch.cat([t.expand(*lead, t.size(-1)) for t in blocks], -1)
