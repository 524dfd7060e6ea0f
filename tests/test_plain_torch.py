"""The modules as plain PyTorch, and the plugin's global state only where fairseq uses it.

* fairseq blocked from import: ``fairseq_attnzoo.modules`` and every module in it import, and each
  family (PKM / Memory+, Synthesizer, AOP, collab, adaptive span, plain MHA) trains one optimizer
  step inside a plain PyTorch model; no fairseq module is loaded, no torch global hook is
  registered, nothing in torch or NumPy is changed;
* fairseq installed: a script that imports only our modules and trains the same model gets no
  compat entry applied (``compat.status()`` empty, every patched object as fairseq/torch/NumPy ship
  it), no global hook; the names are registered with fairseq's registries (harmless);
* ``fairseq_attnzoo.enable()`` applies the table; ``--user-dir`` (fairseq's
  ``import_user_module``) and building one of our models apply it by themselves;
* an adaptive-span model built for ``--fp16`` refuses, in one line naming the entry, when
  ``fairseq_fp16_master_projection`` is disabled or skipped;
* spans are projected by the optimizer the user attaches (:func:`attach_projection`) or by the
  model after each update of fairseq's trainer, never by a hook on every optimizer.

Each scenario runs in a process of its own, as ``python -c`` (the table is applied once per
process), forked from one that imported torch, and fairseq where the scenario has it
(tests/console_server.py).
"""

import os

import pytest

from preptest_util import REPO
from test_compat_table import CONSOLE_ONLY, _environ, _python_env


#: blocks ``import fairseq`` (and fairseq_cli) in this interpreter, as if it were not installed
BLOCK_FAIRSEQ = '''
import sys
class _NoFairseq:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fairseq", "fairseq_cli"):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, _NoFairseq())
'''

#: what the process looked like before anything of ours was imported
BEFORE = '''
import argparse, json, sys
import numpy as np, torch
from torch.nn.modules import module as _nn_module
from torch.optim import optimizer as _optim
_excepthook = sys.excepthook
def _global_state():
    return {
        "optimizer_hooks": len(_optim._global_optimizer_pre_hooks)
                           + len(_optim._global_optimizer_post_hooks),
        "module_hooks": sum(len(getattr(_nn_module, n)) for n in dir(_nn_module)
                            if n.startswith("_global_") and n.endswith("_hooks")
                            and isinstance(getattr(_nn_module, n), dict)),
        "namespace_allowed": argparse.Namespace in torch.serialization.get_safe_globals(),
        "np_compat": hasattr(np, "compat"),
        "excepthook_changed": sys.excepthook is not _excepthook,
    }
'''

#: one optimizer step of a plain PyTorch model holding every family
TRAIN = '''
import importlib, pkgutil
import torch.nn as nn
import fairseq_attnzoo.modules as modules
imported = sorted(m.name for m in pkgutil.iter_modules(modules.__path__))
for name in imported:
    importlib.import_module(f"fairseq_attnzoo.modules.{name}")
from fairseq_attnzoo.modules.adaptive_span import AdaptiveSpanLayer
from fairseq_attnzoo.modules.aop import AttentionOverParameters
from fairseq_attnzoo.modules.collab import CollaborativeAttention
from fairseq_attnzoo.modules.constrained import attach_projection
from fairseq_attnzoo.modules.pkm import ProductKeyMemory
from fairseq_attnzoo.modules.sdpa import ZooMultiheadAttention
from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

D, T, B = 16, 6, 2
torch.manual_seed(0)
families = {
    "pkm": ProductKeyMemory(D, n_keys=8, heads=2, knn=4, k_dim=8),
    "memory_plus": ProductKeyMemory(D, n_keys=8, heads=2, knn=4, k_dim=8, swilu="reference",
                                    qk_norm=True),
    "synthesizer": SynthesizerAttention(D, 2, components=("random", "dense"), max_len=T),
    "aop": AttentionOverParameters(D, heads=2, key_dim=4, value_dim=4, slots=8),
    "collab": CollaborativeAttention(D, 2, key_dim=8),
    "mha": ZooMultiheadAttention(D, 2),
}
x = torch.randn(T, B, D)
trained = {}
for name, layer in families.items():
    model = nn.Sequential(nn.Linear(D, D))
    opt = torch.optim.Adam(list(model.parameters()) + list(layer.parameters()), lr=1e-2)
    h = model(x)
    y = layer(h) if name in ("pkm", "memory_plus", "aop") else layer(h, h, h)[0]
    y.pow(2).mean().backward()
    before = [p.detach().clone() for p in layer.parameters()]
    opt.step()
    trained[name] = any(not torch.equal(a, p.detach()) for a, p in zip(before, layer.parameters()))
# adaptive span: batch-first blocks; the span (a UnitIntervalParameter) is pushed out of [0, 1]
# and projected back by the hook attached to this optimizer
span = AdaptiveSpanLayer(D, 2, 32, max_span=8, ramp=2, span_init=0.5, span_loss=1.0)
opt = torch.optim.SGD(span.parameters(), lr=100.0)
attach_projection(opt)
out, _ = span(x.transpose(0, 1), torch.randn(1, D // 2, 8))
(out.pow(2).mean() + span.attn.mask.span.sum() * -1).backward()
opt.step()
z = span.attn.mask.span
trained["adaptive_span"] = bool(z.max() == 1.0 and z.min() >= 0.0)
'''

REPORT = '''
result = dict(_global_state(), imported=imported, trained=trained,
              fairseq_loaded=sorted(m for m in sys.modules
                                    if m.split(".")[0] in ("fairseq", "fairseq_cli")))
'''


def _python(code: str, preload=("fairseq",), **env) -> dict:
    """Run ``code`` as ``python -c`` runs it (test_compat_table's ``_python_env``: forked from a
    process that imported torch and ``preload``, never our package); it leaves a dict in
    ``result``, returned here. A code that blocks fairseq passes ``preload=()``."""
    return _python_env(code + "\nprint(json.dumps(result))\n",
                       dict(_environ(), OMP_NUM_THREADS="1", **env), preload=preload, timeout=300)


UNCHANGED = {"optimizer_hooks": 0, "module_hooks": 0, "namespace_allowed": False,
             "np_compat": False, "excepthook_changed": False}
FAMILIES = {"pkm", "memory_plus", "synthesizer", "aop", "collab", "mha", "adaptive_span"}


def _unchanged(got):
    return {k: got[k] for k in UNCHANGED} == UNCHANGED


def test_modules_import_and_train_without_fairseq():
    got = _python(BLOCK_FAIRSEQ + BEFORE + "import fairseq_attnzoo\n" + TRAIN + REPORT
                  + "result['registered'] = hasattr(fairseq_attnzoo, 'models')\n", preload=())
    assert {"pkm", "synthesizer", "aop", "collab", "adaptive_span", "span_stack",
            "constrained", "precision", "attention"} <= set(got["imported"])
    assert got["trained"] == {name: True for name in FAMILIES}
    assert got["fairseq_loaded"] == []
    assert not got["registered"]  # no fairseq: nothing to register with
    assert _unchanged(got), got


def test_enable_without_fairseq_says_what_to_install():
    code = BLOCK_FAIRSEQ + '''
import json
import fairseq_attnzoo
try:
    fairseq_attnzoo.enable()
    result = {"error": None}
except ImportError as e:
    result = {"error": str(e)}
'''
    error = _python(code, preload=())["error"]
    assert error.startswith("fairseq_attnzoo needs fairseq") and "fairseq-fixed==0.12.3.1" in error
    assert "\n" not in error


#: the objects the compat entries replace, as fairseq ships them (source digests)
SHIPPED = '''
from fairseq_attnzoo import compat
def _targets():
    from fairseq import options
    from fairseq.data import data_utils
    from fairseq.distributed import utils as distributed_utils
    from fairseq.logging import meters
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.optim.fp16_optimizer import FP16Optimizer, _FP16OptimizerMixin
    from fairseq.tasks.language_modeling import LanguageModelingTask
    from fairseq.trainer import Trainer
    d = compat.source_digest
    return {
        "amp": d(AMPOptimizer.step), "sync": d(_FP16OptimizerMixin._sync_fp32_params_to_fp16),
        "grads": d(_FP16OptimizerMixin._sync_fp16_grads_to_fp32),
        "bf16": d(FP16Optimizer.build_optimizer), "call_main": d(distributed_utils.call_main),
        "batch": d(data_utils.batch_by_size), "train_step": d(Trainer.train_step),
        "eval_lm": d(LanguageModelingTask.eval_lm_dataloader),
        "model_args": d(options.add_model_args), "dataset_args": d(options.add_dataset_args),
        "meter": hasattr(meters, "SlotUsageMeter"),
    }
'''
FAIRSEQ_AS_SHIPPED = {"amp": "2b8a6f80fa6ca14b", "sync": "a53fdba609963e2d",
                      "grads": "9a06568699ab4d06", "bf16": "c7ff6d890b7d4239",
                      "call_main": "c2a32fa44fa277a6", "batch": "10c0b48b47357f22",
                      "train_step": "8cbf0406b1fe5093", "eval_lm": "6ae1cc56dea42151",
                      "model_args": "1c18c8c34cb60493", "dataset_args": "d28d7bdb8e29e2c3",
                      "meter": False}


def test_plain_pytorch_script_with_fairseq_installed_changes_nothing():
    got = _python(BEFORE + TRAIN + SHIPPED + REPORT + '''
from fairseq.models import ARCH_MODEL_REGISTRY
result.update(status=compat.status(), targets=_targets(),
              registered="transformer_pkm" in ARCH_MODEL_REGISTRY)
''')
    assert got["trained"] == {name: True for name in FAMILIES}
    assert got["status"] == {}, "a plain PyTorch script got compat entries applied"
    assert got["targets"] == FAIRSEQ_AS_SHIPPED
    assert _unchanged(got), got
    assert got["registered"]  # the names are registered (harmless)
    assert "compat:" not in got["stderr"] and "compat patches" not in got["stderr"]


#: the entries that change something only in a console script (unchanged in these scripts)


def _applied(status) -> bool:
    """Every entry applied, but the console-only ones, which changed nothing here."""
    return status == {n: "unchanged" if n in CONSOLE_ONLY else "applied" for n in status}


def test_enable_applies_the_table_and_user_dir_import_does_too():
    """``fairseq_attnzoo.enable()`` in a script; fairseq's ``import_user_module`` (what
    ``--user-dir`` and hydra's ``common.user_dir`` call) in another interpreter."""
    enabled = _python(BEFORE + SHIPPED + '''
import fairseq_attnzoo
before = dict(compat.status())
status = fairseq_attnzoo.enable()
result = dict(_global_state(), before=before, status=status, targets=_targets())
''')
    user_dir = _python(BEFORE + '''
import argparse
from fairseq import utils
utils.import_user_module(argparse.Namespace(user_dir=%r))
from fairseq_attnzoo import compat
result = dict(_global_state(), status=compat.status())
''' % os.path.join(REPO, "fairseq_attnzoo"))
    for got in (enabled, user_dir):
        assert _applied(got["status"]) and len(got["status"]) >= 13
        assert got["namespace_allowed"] and got["np_compat"]
        assert got["optimizer_hooks"] == 0 and got["module_hooks"] == 0  # never a global hook
    assert enabled["before"] == {}
    assert enabled["targets"]["amp"] != FAIRSEQ_AS_SHIPPED["amp"] and enabled["targets"]["meter"]


def test_undoing_the_table_gives_back_what_fairseq_torch_and_numpy_shipped():
    """``compat.undo_all()`` after ``enable()``: every target the table changed is back (the
    console-only entries changed nothing here: unchanged, nothing to undo), the table is as
    before it was applied."""
    got = _python(BEFORE + SHIPPED + '''
import fairseq_attnzoo
before = dict(_global_state(), targets=_targets())
fairseq_attnzoo.enable()
undone = compat.undo_all()
result = dict(before=before, after=dict(_global_state(), targets=_targets()), undone=undone,
              left=compat.status(), names=[p.name for p in compat.PATCHES])
''')
    assert got["before"]["targets"] == FAIRSEQ_AS_SHIPPED and got["after"] == got["before"]
    assert got["left"] == {}
    assert sorted(got["undone"] + sorted(CONSOLE_ONLY)) == sorted(got["names"])


def test_building_our_model_applies_the_table():
    got = _python(BEFORE + '''
import fairseq_attnzoo
from fairseq_attnzoo import compat
from fairseq.data import Dictionary
from fairseq_attnzoo.models.adaptive_span import AdaptiveSpanLanguageModel
before = dict(compat.status())
d = Dictionary()
args = argparse.Namespace(arch="adaptive_span_lm_small", decoder_layers=1, decoder_embed_dim=8,
                          decoder_ffn_embed_dim=16, decoder_attention_heads=2, attn_span=8)
task = argparse.Namespace(target_dictionary=d)
AdaptiveSpanLanguageModel.build_model(args, task)
result = dict(before=before, status=compat.status())
''')
    assert got["before"] == {}
    assert _applied(got["status"])


_FP16_SPAN = '''
import argparse, json
import fairseq_attnzoo
from fairseq.data import Dictionary
from fairseq_attnzoo.models.adaptive_span import AdaptiveSpanLanguageModel
result = {}
for flags in ({"fp16": True}, {"bf16": True}, {"fp16": True, "memory_efficient_fp16": True},
              {"fp16": True, "amp": False}, {}):
    args = argparse.Namespace(arch="adaptive_span_lm_small", decoder_layers=1,
                              decoder_embed_dim=8, decoder_ffn_embed_dim=16,
                              decoder_attention_heads=2, attn_span=8, **flags)
    try:
        task = argparse.Namespace(target_dictionary=Dictionary())
        AdaptiveSpanLanguageModel.build_model(args, task)
        result[json.dumps(flags)] = None
    except ValueError as e:
        result[json.dumps(flags)] = str(e)
'''


@pytest.mark.parametrize("how", ["disabled", "skipped"])
def test_span_model_under_fp16_refuses_without_the_master_projection(how):
    prelude = ""
    env = {}
    if how == "disabled":
        env["ATTNZOO_COMPAT_DISABLE"] = "fairseq_fp16_master_projection"
    else:  # another fairseq's FP16Optimizer sync: the entry is skipped
        prelude = ("from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin\n"
                   "def _sync_fp32_params_to_fp16(self):  # another fairseq's\n"
                   "    pass\n"
                   "_FP16OptimizerMixin._sync_fp32_params_to_fp16 = _sync_fp32_params_to_fp16\n")
    got = _python(prelude + _FP16_SPAN, **env)
    refused = {k: v for k, v in got.items() if k != "stderr" and v is not None}
    assert set(refused) == {'{"fp16": true}', '{"bf16": true}', '{"fp16": true, "amp": false}'}
    for message in refused.values():
        assert message.startswith(
            "adaptive spans under --fp16/--bf16 (fp32 master copies kept in [0, 1]) needs the "
            "compat entry fairseq_fp16_master_projection")
        assert "\n" not in message
        assert ("ATTNZOO_COMPAT_DISABLE" in message) == (how == "disabled")
        assert ("install fairseq-fixed==0.12.3.1" in message) == (how == "skipped")


def test_span_model_under_fp16_builds_with_the_table_applied():
    got = _python(_FP16_SPAN)
    assert all(v is None for k, v in got.items() if k != "stderr")


def test_fp16_optimizer_detected_from_argparse_and_hydra_configs():
    """fairseq-train builds the model from the whole Namespace; fairseq-hydra-train from the
    ``model`` node of its config, whose run flags live in ``common``."""
    import argparse

    from omegaconf import OmegaConf

    from fairseq_attnzoo.models.adaptive_span import uses_fp16_optimizer

    ns = argparse.Namespace
    assert uses_fp16_optimizer(ns(fp16=True)) and uses_fp16_optimizer(ns(bf16=True))
    assert not uses_fp16_optimizer(ns(fp16=True, memory_efficient_fp16=True))
    assert not uses_fp16_optimizer(ns(fp16=True, amp=True)) and not uses_fp16_optimizer(ns())
    for common, expected in (({"fp16": True}, True), ({"bf16": True, "memory_efficient_bf16": True},
                                                      False), ({}, False)):
        cfg = OmegaConf.create({"common": common, "model": {"_name": "attnzoo_adaptive_span_lm"}})
        assert uses_fp16_optimizer(cfg.model) is expected, common
