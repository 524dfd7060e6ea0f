"""``attnzoo-plot KIND ...``: the method pictures of a trained checkpoint (needs the ``analysis``
extra: ``pip install 'fairseq-attnzoo[analysis]'``).

======================  ===========================================================================
KIND                    picture
======================  ===========================================================================
``spans``               learned attention span per layer and head (adaptive span, All-Attention)
``pkm-usage``           product-key memory slot usage and KL to uniform over a data split
``qk-spectrum``         energy spectrum of the heads' key/query products (collaborative heads)
``synthesizer``         synthesized attention next to a vanilla model's, and the mixture weights
======================  ===========================================================================

``attnzoo-plot KIND --help`` shows each one's options.
"""

import importlib
import sys

KINDS = {
    "spans": "plot_spans",
    "pkm-usage": "plot_pkm_usage",
    "qk-spectrum": "plot_qk_spectrum",
    "synthesizer": "plot_synthesizer",
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    kind, rest = argv[0], argv[1:]
    if kind not in KINDS:
        raise SystemExit(f"error: unknown plot {kind!r}; choose from: {', '.join(KINDS)} "
                         "(attnzoo-plot KIND --help)")
    module = importlib.import_module(f"{__package__}.{KINDS[kind]}")
    module.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
