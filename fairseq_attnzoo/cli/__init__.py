"""Console commands of fairseq-attnzoo (``setup.py``'s ``console_scripts``; each module also runs
as ``python -m fairseq_attnzoo.cli.<name>``):

==================================  ==========================================================
command                             module
==================================  ==========================================================
``attnzoo-archs [ARCH]``            :mod:`.archs`: every arch, its flags, defaults, sublayers
``attnzoo-sample``                  :mod:`.sample`: sample or beam-search from an LM checkpoint
``attnzoo-average-checkpoints``     :mod:`.average_checkpoints`: average the last N checkpoints
``attnzoo-collab-reparametrize``    :mod:`.collab_reparametrize`: MHA -> collaborative heads
``attnzoo-plot KIND ...``           :mod:`.plot`: spans, pkm-usage, qk-spectrum, synthesizer
==================================  ==========================================================

Importing this package has no side effects (importing ``fairseq_attnzoo`` registers the archs);
each command's ``main`` is a :func:`command`: it uses the plugin with fairseq.
"""

import functools
import importlib
import os

from .. import enable


def command(main):
    """A console command's ``main``: it runs fairseq with the plugin (loads our checkpoints,
    builds our models), so the compat table is applied first (:func:`fairseq_attnzoo.enable`;
    without a supported fairseq, the one line saying what to install)."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        enable()
        return main(*args, **kwargs)

    return run


def require(module: str, extra: str = "analysis"):
    """Import an optional dependency, or exit with one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(f"error: this command needs {module.split('.')[0]}, which is not "
                         f"installed: run `pip install 'fairseq-attnzoo[{extra}]'`") from None


def save_figure(fig, path: str, dpi: int = 120) -> str:
    """Lay ``fig`` out, write it to ``path`` (:func:`output_file`) and close it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=dpi)
    require("matplotlib.pyplot").close(fig)
    return path


def output_file(path: str) -> str:
    """``path`` with its folder created (the plot commands write into folders that need not
    exist yet)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return path
