"""Plain PyTorch modules (no fairseq imports needed): one paper per file, on a shared extension
point (``attention.py``, ``feedforward.py``) with the reduced-precision and constrained-parameter
helpers (``precision.py``, ``constrained.py``). Nothing here changes another library at import."""

from .attention import AttnContext, ZooAttention, mask_scope  # noqa: F401
from .feedforward import ZooFeedForward  # noqa: F401
from .sdpa import ZooMultiheadAttention  # noqa: F401
