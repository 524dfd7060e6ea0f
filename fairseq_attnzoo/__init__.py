"""fairseq-attnzoo: attention and memory variants as fairseq architectures.

Use with the stock fairseq tools: ``fairseq-train ... --user-dir fairseq_attnzoo --arch ...``.
Importing this package registers every model, architecture, task, criterion and optimizer.
"""

__version__ = "0.1.0"

SUPPORTED_FAIRSEQ = ((0, 12, 3), (0, 13, 0))  # [min, max): fairseq-fixed 0.12.3.x


def _check_fairseq():
    try:
        import fairseq
    except ImportError as e:  # pragma: no cover
        raise ImportError(
            "fairseq_attnzoo needs fairseq: run `make install` (or `pip install --no-build-isolation "
            "fairseq-fixed==0.12.3.1` after installing torch)") from e
    version = tuple(int(p) for p in fairseq.__version__.split(".")[:3] if p.isdigit())
    lo, hi = SUPPORTED_FAIRSEQ
    if not (lo <= version < hi):
        raise ImportError(
            f"fairseq_attnzoo supports fairseq >= {'.'.join(map(str, lo))}, < "
            f"{'.'.join(map(str, hi))} but found {fairseq.__version__}: install "
            "fairseq-fixed==0.12.3.1 (see README, Installation)")


_check_fairseq()

from . import models  # noqa: E402,F401  (registers the models and every arch)


def _import_all(package: str):
    import importlib
    import pkgutil

    pkg = importlib.import_module(f"{__name__}.{package}")
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{m.name}")


for _package in ("criterions", "tasks", "optim"):
    _import_all(_package)


from . import compat  # noqa: E402  (every patch of fairseq/torch/numpy: one table)

compat.apply_all()
