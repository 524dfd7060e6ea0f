"""Four fixes to fairseq's mixed-precision optimizer wrappers (rows of the table, :mod:`.fixes`),
and, at the end, the one that trains fairseq's ``--bf16`` without a TPU and the one that scores
in bfloat16 under ``--bf16`` (:func:`bf16_scoring`).

1. **Parameter constraints under FP16Optimizer** (see below).
2. **AMP unscales gradients twice.** ``AMPOptimizer.clip_grad_norm`` (called by the trainer on every
   update) unscales through the *torch* optimizer, ``scaler.unscale_(self.optimizer)``, but
   ``AMPOptimizer.step`` hands the *fairseq wrapper* to ``scaler.step(self.fp32_optimizer)``. The
   GradScaler keeps its "already unscaled" state per optimizer object, so ``step`` unscales a second
   time: every update is divided by the loss scale once more (measured: an SGD step of 1/128 of the
   gradient at the initial scale 128). Adam notices once the scale has grown (its
   update is scale-invariant only while the gradient is large against ε: at scale 2¹⁶ a gradient of
   1e-4 gets 13 % of its intended update, ``tests/test_amp_adam.py``); SGD, Adagrad and any
   per-tensor clipping notice it at every scale -- ``adagrad_clip`` (adaptive span) stopped
   learning at unigram statistics under ``--amp`` on an H100 (CHANGELOG). The fix steps the same
   torch optimizer the scaler unscaled.
3. **bf16 keeps one fp32 master per parameter.** ``FP16Optimizer.build_optimizer`` never flattens
   the masters under ``--bf16`` ("mixed precision is faster on TPUs without flat grads"). Off a TPU
   that turns every update into Python loops over the parameters (gradient copy, Adam, clipping,
   the copy back): most of the ops a transformer-base update dispatches, on a GPU that waits
   for the host (CHANGELOG). :func:`build_bf16_flat` gives bf16 the layout ``--fp16``
   has: one flat fp32 buffer, unless ``--fp16-no-flatten-grads``, ``--tpu`` or an optimizer that
   does not take flat parameters (``pkm_adam``, ``adagrad_clip``), where fairseq's choice stands.
4. **The flat buffer is filled and read one parameter at a time.** With flat masters (``--fp16``,
   and ``--bf16`` after fix 3) fairseq copies every gradient into its slice and every master back
   into the model in Python loops (five dispatched ops per parameter and direction: ``.data``
   twice, a slice, a view, the copy). :func:`flat_grads_sync` and :func:`flat_params_sync` do each
   direction as one ``torch._foreach_copy_`` over views of the buffer made once per buffer. The
   values are the same copies.

Constraints: a :class:`~fairseq_attnzoo.modules.constrained.BoundedParameter` (e.g. an adaptive
span) is projected into its bounds after every update by the model that owns it (fairseq's trainer
calls the model after each step, ``models/adaptive_span.py``). That covers every case in which the
optimizer updates the model's own parameters: fp32, ``--amp`` (``AMPOptimizer``: fp32 parameters)
and ``--memory-efficient-fp16``/``--memory-efficient-bf16`` (the optimizer steps the half
parameters directly).

Under ``--fp16``/``--bf16`` fairseq's ``FP16Optimizer`` steps **fp32 master copies** (a list, or
one flat buffer per device) and then copies them into the half model in
``_sync_fp32_params_to_fp16``. Clamping the half model alone is undone by that copy and lets the
masters drift out of range (the span penalty pushes them below 0, and the span has to climb back).
So the copy is wrapped, once, to project the masters of bounded parameters first -- the same
projection on the tensors the optimizer really updates. Offsets follow fairseq's own layout
(parameters that require gradients, grouped by ``device.index``, in order).
"""

import importlib.util
import inspect
import logging
import os
import sys
from collections import defaultdict

import torch

logger = logging.getLogger("fairseq_attnzoo.compat")  # the name its log lines have always had


def _bounded(p) -> bool:
    """A :class:`~fairseq_attnzoo.modules.constrained.BoundedParameter` (it projects a tensor into
    its bounds: ``project_tensor_``)."""
    return callable(getattr(p, "project_tensor_", None))


def project_masters_(fp16_params, fp32_params) -> int:
    """Clamp the fp32 master copies of the bounded parameters among ``fp16_params``; returns how
    many were projected. ``fp32_params``: FP16Optimizer's list, or its ``{device: flat buffer}``."""
    n = 0
    if isinstance(fp32_params, dict):  # flattened: one buffer per device, params in order
        by_device = defaultdict(list)
        for p in fp16_params:
            if p.requires_grad:
                by_device[p.device.index].append(p)
        for device, flat in fp32_params.items():
            offset = 0
            for p in by_device[device]:
                if _bounded(p):
                    p.project_tensor_(flat.data[offset: offset + p.numel()])
                    n += 1
                offset += p.numel()
    else:
        for p, p32 in zip(fp16_params, fp32_params):
            if _bounded(p):
                p.project_tensor_(p32.data)
                n += 1
    return n


def amp_step(self):
    """``AMPOptimizer.step``: step the torch optimizer that ``clip_grad_norm`` unscaled (fairseq's
    own passes its wrapper, which the GradScaler then unscales again). Same update otherwise: the
    wrapper's ``step`` only forwards to this optimizer. Installed by :mod:`fairseq_attnzoo.compat`."""
    self.scaler.step(self.optimizer)
    self.scaler.update()


def projecting_sync(sync):
    """Wrap ``FP16Optimizer._sync_fp32_params_to_fp16`` to project bounded masters first.
    Installed by :mod:`fairseq_attnzoo.compat`."""

    def _sync_fp32_params_to_fp16(self):
        project_masters_(self.fp16_params, self.fp32_params)
        sync(self)

    return _sync_fp32_params_to_fp16


def bf16_flat_build(original):
    """``FP16Optimizer.build_optimizer`` (the function of the classmethod ``original``) that
    builds flat masters under ``--bf16`` where :func:`build_bf16_flat` can."""

    def build_optimizer(cls, cfg, params, **kwargs):
        params = list(params)
        built = build_bf16_flat(cls, cfg, params, **kwargs)
        return built if built is not None else original(cls, cfg, params, **kwargs)

    return build_optimizer


def build_bf16_flat(cls, cfg, params: list, **kwargs):
    """``FP16Optimizer.build_optimizer`` for ``--bf16`` with flat fp32 masters (the ``--fp16``
    layout), or None where fairseq's own per-parameter masters stand: not bf16, ``--tpu``,
    ``--fp16-no-flatten-grads``, parameters on several devices, or an optimizer that does not take
    flat parameters. Installed by :mod:`fairseq_attnzoo.compat`."""
    from fairseq import optim

    common = cfg.common
    if (not getattr(common, "bf16", False) or getattr(common, "tpu", False)
            or getattr(common, "fp16_no_flatten_grads", False)):
        return None
    if len({p.device for p in params}) != 1:
        return None
    probe = torch.nn.Parameter(torch.zeros(1))
    if not optim.build_optimizer(cfg.optimizer, [probe]).supports_flat_params:
        return None
    fp32_params = flat_masters(cls, cfg.optimizer, params)
    return cls(cfg, params, optim.build_optimizer(cfg.optimizer, [fp32_params]), fp32_params,
               **kwargs)


def flat_masters(cls, args, params):
    """fairseq's flat fp32 masters ``{device index: flat Parameter with .grad}``. On CUDA fairseq
    builds them; elsewhere its builder asks ``torch.cuda.current_device()``, so the same layout is
    built here, keyed by the parameters' ``device.index`` as fairseq's syncs look it up."""
    if params[0].is_cuda:
        return cls.build_fp32_params(args, params, flatten=True)
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    flat = torch.nn.Parameter(flat)
    flat.grad = torch.zeros_like(flat.data)
    return {params[0].device.index: flat}


def _flat_views(self, device, params, grads: bool):
    """The slices of the flat fp32 buffer of ``device`` (or of its ``.grad``) shaped like
    ``params``, in fairseq's layout; made once and kept while fairseq keeps the same buffer."""
    flat = self.fp32_params[device]
    cache = self.__dict__.setdefault("_attnzoo_flat_views", {})
    hit = cache.get((device, grads))
    if hit is None or hit[0] is not flat or hit[1] is not flat.grad or len(hit[2]) != len(params):
        base = flat.grad if grads else flat.detach()
        views = [v.view_as(p) for v, p in zip(base.split([p.numel() for p in params]), params)]
        hit = cache[(device, grads)] = (flat, flat.grad, views)
    return hit[2]


def flat_grads_sync(sync):
    """``_FP16OptimizerMixin._sync_fp16_grads_to_fp32`` for flat masters: one multi-tensor copy
    per device (a parameter without a gradient gets zeros, as in fairseq). Installed by
    :mod:`fairseq_attnzoo.compat`."""

    def _sync_fp16_grads_to_fp32(self):
        if not (self._needs_sync and isinstance(self.fp32_params, dict) and self.has_flat_params):
            return sync(self)
        with torch.no_grad():
            for device in self.fp32_params:
                params = [p for p in self.fp16_params
                          if p.requires_grad and p.device.index == device]
                views = _flat_views(self, device, params, grads=True)
                pairs = [(v, p.grad) for v, p in zip(views, params) if p.grad is not None]
                if pairs:
                    torch._foreach_copy_([v for v, _ in pairs], [g for _, g in pairs])
                if len(pairs) < len(params):
                    torch._foreach_zero_([v for v, p in zip(views, params) if p.grad is None])
        self._needs_sync = False

    return _sync_fp16_grads_to_fp32


def flat_params_sync(sync):
    """``_FP16OptimizerMixin._sync_fp32_params_to_fp16`` for flat masters: one multi-tensor copy
    per device. Installed by :mod:`fairseq_attnzoo.compat`."""

    def _sync_fp32_params_to_fp16(self):
        if not (isinstance(self.fp32_params, dict) and self.has_flat_params):
            return sync(self)
        with torch.no_grad():
            for device in self.fp32_params:
                params = [p for p in self.fp16_params if p.device.index == device]
                torch._foreach_copy_(params, _flat_views(self, device, params, grads=False))

    return _sync_fp32_params_to_fp16


# ---- fairseq --bf16 on GPUs and CPUs (the row fairseq_bf16_without_tpu) --------------------------

def tpu_requested(argv) -> bool:
    """Whether the command line asked for TPUs itself (fairseq's ``--tpu``)."""
    return any(a == "--tpu" for a in argv)


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def bf16_without_tpu(cfg, argv) -> bool:
    """Turn off the ``--tpu`` that fairseq 0.12's ``--bf16`` implied, when the user did not ask for
    TPUs and torch_xla is not installed; returns whether it did. fairseq's own bf16 path is then
    what trains: the model in bfloat16, fp32 master weights in ``FP16Optimizer`` (no loss scaling),
    on the GPU (or the CPU with ``--cpu``), exactly as ``fairseq-hydra-train common.bf16=true``."""
    common = cfg.common
    if not (common.bf16 and common.tpu) or tpu_requested(argv) or xla_available():
        return False
    for section in cfg.values():  # common, distributed_training, task, optimizer copy the flag
        if hasattr(section, "get") and section.get("tpu", False) is True:
            section.tpu = False
    logger.info("--bf16 without --tpu: training in bfloat16 with fp32 master weights on "
                f"{'the CPU' if common.cpu else 'CUDA'} (fairseq's bf16 path; compat entry "
                "fairseq_bf16_without_tpu)")
    return True


def without_tpu(call_main):
    """fairseq's ``call_main`` that first turns off the ``--tpu`` fairseq's ``--bf16`` implied
    (:func:`bf16_without_tpu`)."""

    def patched_call_main(cfg, main, **kwargs):
        bf16_without_tpu(cfg, sys.argv[1:])
        return call_main(cfg, main, **kwargs)

    return patched_call_main


# ---- --bf16 at scoring time ----------------------------------------------------------------------

#: fairseq's scoring commands, by file: each runs its model in half precision under --fp16 only
SCORING = tuple(os.path.join("fairseq_cli", name + ".py")
                for name in ("generate", "eval_lm", "interactive", "validate"))


def scoring_cfg():
    """The config of the fairseq scoring command (generate, eval-lm, interactive, validate) whose
    ``main`` is running this call, or None (training, a script of the user's)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_filename.endswith(SCORING) and "cfg" in frame.f_locals:
            return frame.f_locals["cfg"]
        frame = frame.f_back
    return None


def bf16_scoring_wanted(common) -> bool:
    """``--bf16`` (or ``--memory-efficient-bf16``) without ``--fp16``, whose ``half()`` wins
    (fairseq's own choice)."""
    return bool(getattr(common, "bf16", False)) and not getattr(common, "fp16", False)


def check_bf16_device(common) -> None:
    """Refuse, in one line, --bf16 scoring on a CUDA device without bfloat16 arithmetic (before
    Ampere); the CPU and newer GPUs run it."""
    from ..messages.errors import ZooConfigError

    if getattr(common, "cpu", False) or not torch.cuda.is_available():
        return
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name()
        raise ZooConfigError(f"--bf16: {name} has no bfloat16 arithmetic: score with --fp16, or "
                             "in float32 (drop --bf16)")


def bf16_scoring(load_model_ensemble_and_task):
    """``checkpoint_utils.load_model_ensemble_and_task`` that, inside a scoring command run with
    ``--bf16`` (not ``--fp16``), returns the models in bfloat16, as ``--fp16`` has them in float16
    (``model.half()``): stock fairseq 0.12's generate, eval-lm, interactive and validate apply
    only ``--fp16`` and scored in float32 under --bf16 without a word. One INFO line says so."""

    def load_model_ensemble_and_task_bf16(*args, **kwargs):
        ensemble, cfg, task = load_model_ensemble_and_task(*args, **kwargs)
        command = scoring_cfg()
        common = getattr(command, "common", None)
        if common is not None and bf16_scoring_wanted(common):
            check_bf16_device(common)
            for model in ensemble:
                model.bfloat16()
            logger.info(f"--bf16: {len(ensemble)} model(s) in bfloat16 (compat entry "
                        "fairseq_bf16_scoring; fairseq's scoring commands apply only --fp16)")
        return ensemble, cfg, task

    return load_model_ensemble_and_task_bf16
