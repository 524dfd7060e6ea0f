"""fairseq wiring: the zoo transformer, the sublayer registry and every method's registrations.

Each method is one module file in ``fairseq_attnzoo/modules`` plus one registration file here
(archs through :func:`.registry.register_arch`);
importing this package imports them all, so every arch joins the generic test sweep."""

import importlib
import pkgutil

from . import registry, sublayers, transformer  # noqa: F401  (extension point first)

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("registry", "sublayers", "transformer"):
        importlib.import_module(f"{__name__}.{_m.name}")
