"""Backward-compatible names: the shared machinery that used to live here now has one file per
concern.

* :mod:`.attention` -- masks, the incremental-decoding cache, positions (:class:`AttnContext`,
  :func:`positions_from_padding`) and the attention base class :class:`ZooAttention`;
* :mod:`.feedforward` -- the feed-forward base class :class:`ZooFeedForward`;
* :mod:`.precision` -- reduced precision (:func:`fp32_softmax`, :func:`mask_value`,
  :func:`float32_region`, :class:`Float32Module`);
* :mod:`.constrained` -- parameters with a box constraint (:class:`BoundedParameter`);
* :mod:`.constants` -- constant tensors made once (:func:`cached_constant`);
* :mod:`.sdpa` -- plain multi-head attention (:class:`ZooMultiheadAttention`).

Import from those modules in new code; this one only re-exports them.
"""

from .attention import (  # noqa: F401
    AttnContext, FairseqIncrementalState, IncrementalState, ZooAttention, positions_from_padding)
from .constrained import BoundedParameter, UnitIntervalParameter  # noqa: F401
from .constants import cached_constant  # noqa: F401
from .feedforward import ZooFeedForward  # noqa: F401
from .precision import (  # noqa: F401
    HALF_DTYPES, Float32Module, float32_region, fp32_softmax, mask_value)
from .sdpa import ZooMultiheadAttention, init_like_fairseq_mha  # noqa: F401
