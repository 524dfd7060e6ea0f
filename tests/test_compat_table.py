"""The compatibility table (``fairseq_attnzoo/compat/``: its machinery, and the rows of fixes.py).

* every entry of the table is applied on the pinned stack and changes what it says it changes;
* an entry whose target is not the version it was written for is skipped with a warning and leaves
  the target alone; ``ATTNZOO_COMPAT_DISABLE=NAME`` / ``=all`` leave the targets unchanged (these
  run in a process of their own, since patches are applied once per process);
* one undo contract: every row returns its undo or NOTHING_CHANGED (shown as ``unchanged``);
  ``fix()`` patches properties and environment variables; ``undo_all()`` gives back ``os.environ``
  and leaves torch's op registry as it was (importing and enabling register no op either);
* ``fairseq_attnzoo.modules`` changes nothing at import time;
* the eval-lm block check: silent where nothing is skipped (unbounded, tuple or fitting
  positions), one warning line where some blocks are skipped, one-line refusal where all are.

The bounded-parameter projection (``modules/constrained.py``): tests/test_constrained.py.
"""

import json
import os
import sys

import pytest
import torch

import fairseq_attnzoo
from console_server import SERVERS
from fairseq_attnzoo import compat
from fairseq_attnzoo.messages.errors import ZooConfigError
from preptest_util import REPO


fairseq_attnzoo.enable()  # this process uses the plugin with fairseq (the table applied)


def _python(code: str, argv=(), preload=("fairseq",), **env) -> dict:
    """Run ``code`` as ``python -c`` runs it (this checkout first on the path; ``argv`` its
    arguments); it prints one JSON object on its last line, returned here. Its process is forked
    from one that imported torch and ``preload`` (tests/console_server.py: those imports paid
    once; nothing of ours is imported there)."""
    return _python_env(code, dict(_environ(), **env), argv, preload)


def _environ() -> dict:
    """This process's environment without the table's opt-out."""
    return {k: v for k, v in os.environ.items() if k != compat.ENV_DISABLE}


def _python_env(code: str, env: dict, argv=(), preload=("fairseq",), timeout=120) -> dict:
    """:func:`_python` with exactly the environment ``env`` (and this checkout on the path)."""
    env = dict(env, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    code_, stdout, stderr = SERVERS.run("-c", [code, *argv], env=env, cwd=REPO, timeout=timeout,
                                        preload=preload)
    assert code_ == 0, stderr[-3000:]
    return {"stderr": stderr, **json.loads(stdout.strip().splitlines()[-1])}


# ---- the table -----------------------------------------------------------------------------------

#: the rows that change something only in a console script (fairseq-*, attnzoo-*): in this
#: process, and in a ``python -c`` one, they change nothing
CONSOLE_ONLY = {"fairseq_cli_hints", "fairseq_mmap_dataset_del", "python_interrupt_in_callback",
                "fairseq_root_log_level",
                "torch_pin_memory_without_accelerator", "fairseq_cuda_amp_autocast"}


def test_every_entry_is_applied_on_the_pinned_stack():
    import argparse

    import numpy as np
    from fairseq.logging import meters
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin
    from torch.optim import optimizer as torch_optimizer

    from fairseq_attnzoo.compat import mixed_precision

    names = [p.name for p in compat.PATCHES]
    assert len(names) == len(set(names))
    assert compat.status() == {n: compat.UNCHANGED if n in CONSOLE_ONLY else compat.APPLIED
                               for n in names}
    # ... and each did what its entry says
    assert argparse.Namespace in torch.serialization.get_safe_globals()
    assert not torch_optimizer._global_optimizer_post_hooks  # spans: projected by their model
    assert np.compat.long is np.int64
    assert AMPOptimizer.step is mixed_precision.amp_step
    assert _FP16OptimizerMixin._sync_fp32_params_to_fp16.__qualname__.startswith("projecting_sync")
    assert meters.SlotUsageMeter.__module__ == "fairseq_attnzoo.models.pkm"
    from fairseq.trainer import Trainer
    assert Trainer.train_step.__name__ == "train_step_counting_real_batches"
    # applying again is a no-op (once per process)
    assert compat.apply_all() == compat.status()


def test_describe_lists_every_entry_with_its_status_and_target():
    text = compat.describe()
    for p in compat.PATCHES:
        line = next(line for line in text.splitlines() if line.startswith(p.name + " "))
        state = compat.UNCHANGED if p.name in CONSOLE_ONLY else compat.APPLIED
        assert line.split()[1] == state and p.target in line
        assert p.why in text


def test_docs_document_every_entry():
    """docs/compatibility.md's table names every entry and nothing else (a patch users cannot see
    is a patch they cannot opt out of)."""
    with open(os.path.join(REPO, "docs", "compatibility.md")) as f:
        rows = [line for line in f if line.startswith("| `")]
    names = {p.name for p in compat.PATCHES}
    documented = {r.split("`")[1] for r in rows}
    assert documented == names, (f"undocumented: {sorted(names - documented)}; documented but "
                                 f"not in the table: {sorted(documented - names)}")


def test_padding_batch_of_a_mixed_update_counts_nothing_and_runs_first():
    """fairseq_ddp_partial_update: a rank's update [real, padding] ran as [padding, real] with the
    padding batch's sample size and logging outputs times 0; all-real and all-padding updates
    are passed through unchanged."""
    seen = []

    class Task:
        def train_step(self, sample, ignore_grad=False, **kwargs):
            seen.append(sample)
            return 0.0, 7, {"loss": 3.5, "ntokens": 7, "nsentences": 2, "name": "x"}

    class Trainer:
        task = Task()

        def train_step(self, samples, raise_oom=False):
            out = [self.task.train_step(sample=s, ignore_grad=not s) for s in samples]
            return samples, out

    step = compat.padding_batches_first(Trainer.train_step)
    trainer = Trainer()
    real = {"id": torch.tensor([1])}
    order, out = step(trainer, [real, {}])
    assert order == [{}, real]
    assert out[0][1] == 0 and out[0][2] == {"loss": 0.0, "ntokens": 0, "nsentences": 0, "name": "x"}
    assert out[1][1] == 7 and out[1][2]["ntokens"] == 7
    assert "train_step" not in vars(trainer.task)  # the task is left as it was
    for samples in ([real, real], [{}, {}]):
        assert step(trainer, samples)[0] == samples


def test_known_source_check_rejects_another_version():
    def f():
        return 1

    def g():
        return 2

    ok = compat.known_source(lambda: f, compat.source_digest(f))
    assert ok() is None
    reason = compat.known_source(lambda: g, compat.source_digest(f))()
    assert "not the version" in reason and compat.source_digest(g) in reason
    assert "target not found" in compat.known_source(lambda: _missing_attribute(), "x")()


def test_replace_keeps_the_original_and_restore_puts_it_back(monkeypatch):
    """The table's one helper: ``"module:Class.attribute"`` resolved, the wrapper installed with
    the original's docstring (a classmethod stays one), the original (or the inherited attribute)
    back after ``restore``."""
    import types

    class Base:
        @classmethod
        def build(cls, x):
            """Build."""
            return (cls.__name__, x)

        def step(self):
            return "base"

    class Child(Base):
        pass

    module = types.ModuleType("attnzoo_replace_probe")
    module.Base, module.Child = Base, Child
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def twice(build):
        def build_twice(cls, x):
            return build(cls, x) * 2
        return build_twice

    compat.replace("attnzoo_replace_probe:Base.build", twice)
    assert Child.build(1) == ("Child", 1, "Child", 1) and Base.build.__doc__ == "Build."
    compat.replace("attnzoo_replace_probe:Child.step", lambda step: lambda self: step(self) + "!")
    assert Child().step() == "base!" and Base().step() == "base"
    compat.restore("attnzoo_replace_probe:Base.build")
    compat.restore("attnzoo_replace_probe:Child.step")
    assert Child.build(1) == ("Child", 1) and "step" not in vars(Child)


# ---- one undo contract: an undo or NOTHING_CHANGED, the environment and op registry given back -----

#: a fresh interpreter that calls itself ``program``: the environment and what the table shows
#: before ``enable()``, after it and after ``undo_all()``
_UNDO_ENV = """
import json, os, sys
sys.argv[0] = {program!r}
before = dict(os.environ)
hook = sys.excepthook
import fairseq_attnzoo
from fairseq_attnzoo import compat
status = fairseq_attnzoo.enable()
during = dict(hydra=os.environ.get("HYDRA_FULL_ERROR"), changed=dict(os.environ) != before,
              hook=sys.excepthook is not hook, status=status, table=compat.describe())
undone = compat.undo_all()
print(json.dumps(dict(during=during, same=dict(os.environ) == before, hook=sys.excepthook is hook,
                      left=compat.status(), undone=undone)))
"""


@pytest.mark.parametrize("program,user_value", [("/usr/bin/fairseq-hydra-train", None),
                                                ("/usr/bin/fairseq-hydra-train", "0"),
                                                ("/usr/bin/fairseq-train", None)])
def test_undo_all_gives_back_the_process_environment(program, user_value):
    """os.environ equal before ``apply_all`` and after ``undo_all``: fairseq-hydra-train's
    HYDRA_FULL_ERROR=1 (beside the one-line hook, so that hydra re-raises its job's errors) is
    unset again; a value the user set is left as it is."""
    env = {k: v for k, v in _environ().items() if k != "HYDRA_FULL_ERROR"}
    if user_value is not None:
        env["HYDRA_FULL_ERROR"] = user_value
    got = _python_env(_UNDO_ENV.format(program=program), env)
    during = got["during"]
    assert during["hook"] and during["status"]["fairseq_cli_hints"] == compat.APPLIED
    hydra = os.path.basename(program) == "fairseq-hydra-train"
    assert during["hydra"] == (user_value or ("1" if hydra else None))
    assert during["changed"] == (hydra and user_value is None)
    assert got["same"] and got["hook"]
    assert got["left"] == {} and "fairseq_cli_hints" in got["undone"]


def test_rows_that_change_nothing_say_so_and_are_not_undone():
    """In a program that is not a console script the console-only rows change nothing: status and
    table say ``unchanged``, and undo_all has nothing of theirs to undo."""
    got = _python_env(_UNDO_ENV.format(program="probe.py"), _environ())
    assert {n: got["during"]["status"][n] for n in CONSOLE_ONLY} == dict.fromkeys(
        CONSOLE_ONLY, compat.UNCHANGED)
    table = {line.split()[0]: line.split()[1] for line in got["during"]["table"].splitlines()
             if line and not line.startswith(" ")}
    assert {table[n] for n in CONSOLE_ONLY} == {compat.UNCHANGED}
    assert not CONSOLE_ONLY & set(got["undone"]) and got["same"] and got["left"] == {}


#: a module of ours to patch, written to a file (fix() reads its sources' digests)
_PROBE = """
class Probe:
    def __init__(self):
        self.calls = 0

    @property
    def ready(self):
        return False

    def save(self):
        return "saved"

    def load(self):
        return "loaded"
"""

_FIX_ROWS = """
import json, os, sys
sys.path.insert(0, {folder!r})
import fairseq_attnzoo
from fairseq_attnzoo import compat
import attnzoo_probe
P = "attnzoo_probe:Probe."
get = compat.source_digest(attnzoo_probe.Probe.ready)
save, load = (compat.source_digest(getattr(attnzoo_probe.Probe, n)) for n in ("save", "load"))
before = dict(os.environ)
# a property and two methods in one row (the shape of fairseq_sharded_value_checkpoints), and an
# environment variable
compat.fix("probe_property_and_methods", {{
    P + "ready": lambda prop: property(lambda self: True, doc=prop.__doc__),
    P + "save": lambda f: lambda self: f(self) + "!",
    P + "load": lambda f: lambda self: f(self) + "?",
    "env:ATTNZOO_PROBE": lambda value: "on"}}, "probe", None, get, save, load)
compat.fix("probe_keeps", "env:ATTNZOO_PROBE_KEPT", "probe", lambda value: value)
status = fairseq_attnzoo.enable()
p = attnzoo_probe.Probe()
during = [p.ready, p.save(), p.load(), os.environ.get("ATTNZOO_PROBE")]
undone = compat.undo_all()
p = attnzoo_probe.Probe()
after = [p.ready, p.save(), p.load(), os.environ.get("ATTNZOO_PROBE")]
compat.register(compat.Patch("probe_none", "nothing", "probe", compat.always, lambda: None))
try:
    compat.apply_all()
    refused = None
except TypeError as e:
    refused = str(e)
compat.PATCHES.pop()
compat.undo_all()
print(json.dumps(dict(status={{n: status[n] for n in ("probe_property_and_methods",
                                                       "probe_keeps")}},
                      during=during, after=after, undone=undone[:2], refused=refused,
                      same=dict(os.environ) == before)))
"""


def test_fix_patches_a_property_methods_and_an_environment_variable(tmp_path):
    """One ``fix()`` row over a property (its digest is its getter's) and two methods, and an
    environment variable; a row whose wraps return what they were given is ``unchanged``; undo
    gives everything back; a row whose apply returns None (neither an undo nor NOTHING_CHANGED) is
    refused."""
    (tmp_path / "attnzoo_probe.py").write_text(_PROBE)
    got = _python(_FIX_ROWS.format(folder=str(tmp_path)))
    assert got["status"] == {"probe_property_and_methods": compat.APPLIED,
                             "probe_keeps": compat.UNCHANGED}
    assert got["during"] == [True, "saved!", "loaded?", "on"]
    assert got["after"] == [False, "saved", "loaded", None] and got["same"]
    assert got["undone"][0] == "probe_property_and_methods"
    assert got["refused"] == ("compat entry probe_none returned None: a row's apply returns its "
                              "undo or compat.NOTHING_CHANGED")


#: the op registry before and after: everything the plugin's import loads of other libraries is
#: imported first (listed by a first interpreter), so what differs is the plugin's doing
_OPS_IMPORTS = """
import json, sys
before = set(sys.modules)
import fairseq_attnzoo
from fairseq_attnzoo import compat
fairseq_attnzoo.enable()
compat.undo_all()
print(json.dumps(dict(modules=[m for m in sys.modules if m not in before
                               and m.split(".")[0] != "fairseq_attnzoo"])))
"""
_OPS = """
import importlib, json, sys
import torch
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception:
        pass
ops = lambda: set(torch._C._dispatch_get_all_op_names())
before = ops()
import fairseq_attnzoo
imported = ops()
from fairseq_attnzoo import compat
fairseq_attnzoo.enable()
enabled = ops()
compat.undo_all()
undone = ops()
print(json.dumps({k: sorted(v - before) for k, v in
                  dict(imported=imported, enabled=enabled, undone=undone).items()}))
"""


def test_import_enable_and_undo_leave_torchs_op_registry_as_it_was():
    """Importing the package and enabling the table register no op with torch's dispatcher, and
    undo_all leaves none behind (the search kernel's custom ops are registered on first use)."""
    modules = _python(_OPS_IMPORTS)["modules"]
    got = _python(_OPS, argv=[json.dumps(modules)])
    got.pop("stderr")
    assert got == {"imported": [], "enabled": [], "undone": []}


def _missing_attribute():
    raise AttributeError("no such function")


_STATE = """
import argparse, json, sys, numpy as np, torch
{prelude}
import fairseq_attnzoo
from fairseq_attnzoo import compat
fairseq_attnzoo.enable()
from fairseq.optim.amp_optimizer import AMPOptimizer
from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin
from fairseq.logging import meters
from torch.optim import optimizer as o
print(json.dumps({{
    "status": compat.status(),
    "amp_step": AMPOptimizer.step.__qualname__,
    "amp_digest": compat.source_digest(AMPOptimizer.step),
    "sync_digest": compat.source_digest(_FP16OptimizerMixin._sync_fp32_params_to_fp16),
    "np_compat": hasattr(np, "compat"),
    "meter": hasattr(meters, "SlotUsageMeter"),
    "step_hooks": len(o._global_optimizer_post_hooks),
    "namespace_allowed": argparse.Namespace in torch.serialization.get_safe_globals(),
}}))
"""

#: digests of the fairseq functions as shipped (compat.py's known versions)
AMP_DIGEST, SYNC_DIGEST = "2b8a6f80fa6ca14b", "a53fdba609963e2d"


def test_a_changed_target_is_skipped_with_a_warning_and_left_unchanged():
    prelude = ("from fairseq.optim.amp_optimizer import AMPOptimizer\n"
               "def step(self):  # another fairseq's AMPOptimizer.step\n"
               "    self.scaler.step(self.optimizer)\n"
               "AMPOptimizer.step = step\n")
    got = _python(_STATE.format(prelude=prelude))
    assert got["status"]["fairseq_amp_single_unscale"] == compat.SKIPPED
    assert got["amp_step"] == "step"  # ours, not compat's
    assert "fairseq_amp_single_unscale not applied" in got["stderr"]
    assert "left unchanged" in got["stderr"]
    others = {k: v for k, v in got["status"].items() if k != "fairseq_amp_single_unscale"}
    assert others == {k: compat.UNCHANGED if k in CONSOLE_ONLY else compat.APPLIED for k in others}


def test_disable_one_entry_by_name():
    got = _python(_STATE.format(prelude=""),
                  **{compat.ENV_DISABLE: "fairseq_amp_single_unscale, numpy_compat_long,amp"})
    assert "no compat patch named amp; the names are torch_safe_globals_namespace" in got["stderr"]
    assert got["status"]["fairseq_amp_single_unscale"] == compat.DISABLED
    assert got["status"]["numpy_compat_long"] == compat.DISABLED
    assert got["amp_digest"] == AMP_DIGEST and not got["np_compat"]
    assert got["status"]["fairseq_fp16_master_projection"] == compat.APPLIED
    assert got["sync_digest"] != SYNC_DIGEST


def test_disable_all_leaves_every_target_unchanged():
    got = _python(_STATE.format(prelude=""), **{compat.ENV_DISABLE: "all"})
    assert set(got["status"].values()) == {compat.DISABLED}
    assert got["amp_digest"] == AMP_DIGEST and got["sync_digest"] == SYNC_DIGEST
    assert not got["np_compat"] and not got["meter"]
    assert got["step_hooks"] == 0 and not got["namespace_allowed"]


def test_modules_change_nothing_at_import():
    """``fairseq_attnzoo.modules.*`` is plain PyTorch: importing every file of it (without the
    package's ``__init__``, which applies the compat table) registers no optimizer hook, allow-lists
    nothing, patches neither fairseq, numpy nor ``sys.excepthook``."""
    code = """
import argparse, glob, importlib, json, os, sys, types
import numpy as np, torch
from torch.optim import optimizer as o
hook = sys.excepthook
pkg = types.ModuleType("fairseq_attnzoo")  # the package without its __init__ (no compat.apply_all)
pkg.__path__ = [os.path.join(os.getcwd(), "fairseq_attnzoo")]
sys.modules["fairseq_attnzoo"] = pkg
names = sorted(os.path.basename(p)[:-3] for p in glob.glob("fairseq_attnzoo/modules/*.py"))
for name in names:
    importlib.import_module("fairseq_attnzoo.modules" + ("" if name == "__init__" else "." + name))
amp = None
if "fairseq" in sys.modules:
    from fairseq.optim.amp_optimizer import AMPOptimizer
    amp = AMPOptimizer.step.__module__
print(json.dumps({
    "imported": names,
    "hooks": len(o._global_optimizer_post_hooks) + len(o._global_optimizer_pre_hooks),
    "namespace_allowed": argparse.Namespace in torch.serialization.get_safe_globals(),
    "np_compat": hasattr(np, "compat"),
    "excepthook": sys.excepthook is hook,
    "amp": amp,
    "ours": sorted(m for m in sys.modules if m.startswith("fairseq_attnzoo.")
                   and not m.startswith("fairseq_attnzoo.modules")),
}))
"""
    got = _python(code, preload=())  # (fairseq not imported: as a plain PyTorch script)
    assert {"__init__", "attention", "constrained", "precision"} <= set(got["imported"])
    assert got["hooks"] == 0 and not got["namespace_allowed"]
    assert not got["np_compat"] and got["excepthook"]
    assert got["amp"] in (None, "fairseq.optim.amp_optimizer")
    assert got["ours"] == [], "modules/ must not import the fairseq wiring"


# ---- fairseq_eval_lm_block_length ----------------------------------------------------------------

def test_eval_lm_block_check_is_silent_when_nothing_is_skipped():
    sizes = [150, 40]
    for positions in (float("inf"), None, 150, (None, 200), [300, 150]):
        assert compat.check_block_length(sizes, 150, positions) is None, positions
    assert compat.check_block_length(None, 150, 64) is None


@pytest.mark.parametrize("positions", [64, 64.0, (64, None), (1024, 64)])
def test_eval_lm_block_check_warns_with_counts_when_some_blocks_fit(positions):
    """fairseq skips the blocks longer than the model's positions (its filter: size > limit, for
    a tuple any entry) and evaluates the rest: the entry keeps that and says so in one line."""
    warning = compat.check_block_length([150, 40, 64], 150, positions)
    assert warning == ("fairseq-eval-lm skips 1 of 3 blocks (150 of 254 tokens): with "
                       "--tokens-per-sample 150 they are longer than the 64 positions this model "
                       "accepts; pass --tokens-per-sample 64 to evaluate every token")
    eos = compat.check_block_length([150, 40], 512, positions, "eos")
    assert "--tokens-per-sample 512 --sample-break-mode eos" in eos
    assert eos.endswith("pass --sample-break-mode none --tokens-per-sample 64 to evaluate every "
                        "token")


def test_eval_lm_block_check_warns_when_the_context_window_overflows():
    """fairseq filters blocks by their own length; --context-window adds up to that many tokens of
    context: a block that fits alone but not with its context gets the warning too."""
    warning = compat.check_block_length([32, 32, 16], 32, 24, context_window=16)
    assert warning == ("fairseq-eval-lm skips 2 of 3 blocks (64 of 80 tokens): with "
                       "--tokens-per-sample 32 --context-window 16 they are longer than the 24 "
                       "positions this model accepts, and gives the model 1 block of up to 32 "
                       "tokens with their context, beyond the 24 positions it accepts; pass "
                       "--tokens-per-sample 8 --context-window 16 to evaluate every token")
    only = compat.check_block_length([8, 4], 8, 10, context_window=4)
    assert only.startswith("fairseq-eval-lm with --tokens-per-sample 8 --context-window 4 gives "
                           "the model 1 block of up to 12 tokens")
    assert compat.check_block_length([8, 4], 8, 12, context_window=4) is None


def test_eval_lm_block_check_refuses_when_nothing_would_be_evaluated():
    with pytest.raises(ZooConfigError) as e:
        compat.check_block_length([150, 100], 150, 64)
    assert str(e.value) == ("fairseq-eval-lm would evaluate nothing: every block of "
                            "--tokens-per-sample 150 (2 blocks, 250 tokens) is longer than the 64 "
                            "positions this model accepts: pass --tokens-per-sample 64")
