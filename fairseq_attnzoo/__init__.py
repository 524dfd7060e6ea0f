"""fairseq-attnzoo: attention and memory variants as fairseq architectures, and as plain PyTorch
modules.

* With fairseq: ``fairseq-train ... --user-dir fairseq_attnzoo --arch ...`` (or hydra's
  ``common.user_dir``). Importing this package registers every model, architecture, task,
  criterion and optimizer with fairseq's registries; the fixes it makes to fairseq, torch and NumPy
  (``fairseq_attnzoo/compat/``, one table) are applied where fairseq uses the plugin: when
  fairseq imports it as a user dir, when one of its models, tasks, criterions or optimizers is
  built, and when one of its ``attnzoo-*`` commands runs.
* In a script that drives fairseq itself (loads a checkpoint of ours, runs ``fairseq_cli``
  functions), call :func:`enable` first: ``import fairseq_attnzoo; fairseq_attnzoo.enable()``.
  Loading a checkpoint needs it before any model is built (torch's weights-only loader must
  allow-list the ``argparse.Namespace`` fairseq pickles).
* Without fairseq, or in any PyTorch model: ``from fairseq_attnzoo.modules.pkm import
  ProductKeyMemory``. Importing the modules changes nothing in torch, NumPy or fairseq.
"""

import sys
from typing import Dict, Optional

__version__ = "0.1.0"

SUPPORTED_FAIRSEQ = ((0, 12, 3), (0, 13, 0))  # [min, max): fairseq-fixed 0.12.3.x


def _fairseq_problem() -> Optional[str]:
    """None when a supported fairseq imports; otherwise why the fairseq wiring is unavailable."""
    try:
        import fairseq
    except ImportError:
        return ("fairseq_attnzoo needs fairseq for its fairseq models, tasks and commands: run "
                "`make install` (or `pip install --no-build-isolation fairseq-fixed==0.12.3.1` "
                "after installing torch); the plain PyTorch modules (fairseq_attnzoo.modules) "
                "work without it")
    version = tuple(int(p) for p in fairseq.__version__.split(".")[:3] if p.isdigit())
    lo, hi = SUPPORTED_FAIRSEQ
    if not (lo <= version < hi):
        return (f"fairseq_attnzoo supports fairseq >= {'.'.join(map(str, lo))}, < "
                f"{'.'.join(map(str, hi))} but found {fairseq.__version__}: install "
                "fairseq-fixed==0.12.3.1 (see the README, Install)")
    return None


def _imported_by_fairseq() -> bool:
    """Whether this import runs inside fairseq's ``utils.import_user_module`` (``--user-dir``,
    hydra's ``common.user_dir``): fairseq is loading the plugin to use it."""
    utils = sys.modules.get("fairseq.utils")
    loader = getattr(getattr(utils, "import_user_module", None), "__code__", None)
    if loader is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is loader:
            return True
        frame = frame.f_back
    return False


def _register():
    """Import the fairseq wiring: each module registers its names with fairseq's registries."""
    import importlib
    import pkgutil

    from . import models  # noqa: F401  (registers the models and every arch)

    for package in ("criterions", "tasks", "optim"):
        pkg = importlib.import_module(f"{__name__}.{package}")
        for m in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{m.name}")


def enable() -> Dict[str, str]:
    """Use the plugin with fairseq in this process: apply the compatibility table
    (``fairseq_attnzoo/compat/``; idempotent) and return what happened to each entry. fairseq's
    ``--user-dir``, the ``attnzoo-*`` commands and building any of our models, tasks, criterions
    or optimizers do this by themselves; a script that loads a checkpoint or runs fairseq's
    commands in-process calls it first."""
    problem = _fairseq_problem()
    if problem is not None:
        raise ImportError(problem)
    from . import compat

    return compat.apply_all()


_FAIRSEQ_PROBLEM = _fairseq_problem()
if _FAIRSEQ_PROBLEM is None:
    _register()  # names only: registering changes nothing fairseq already had
    if _imported_by_fairseq():
        enable()
elif _imported_by_fairseq():  # --user-dir with an unsupported fairseq
    raise ImportError(_FAIRSEQ_PROBLEM)
elif "fairseq" in sys.modules:  # installed but not a version we support: say so, once
    import logging

    logging.getLogger(__name__).warning(f"{_FAIRSEQ_PROBLEM} (nothing registered)")
