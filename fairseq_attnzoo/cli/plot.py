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

#: KIND -> (its module, what it draws): the docstring's table, and ``attnzoo-plot --help``
KINDS = {
    "spans": ("plot_spans", "learned attention span per layer and head (adaptive span, "
                            "All-Attention)"),
    "pkm-usage": ("plot_pkm_usage", "product-key memory slot usage and KL to uniform over a data "
                                    "split"),
    "qk-spectrum": ("plot_qk_spectrum", "energy spectrum of the heads' key/query products "
                                        "(collaborative heads)"),
    "synthesizer": ("plot_synthesizer", "synthesized attention next to a vanilla model's, and "
                                        "the mixture weights"),
}


def usage() -> str:
    """``--help``: plain text (the docstring is reStructuredText, for the docs)."""
    rows = [f"  {kind:13s} {what}" for kind, (_, what) in KINDS.items()]
    return "\n".join(["usage: attnzoo-plot KIND [options]", "",
                      "The method pictures of a trained checkpoint (needs the analysis extra: "
                      "pip install 'fairseq-attnzoo[analysis]').", "", "KIND:", *rows, "",
                      "attnzoo-plot KIND --help shows each one's options."])


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    kind, rest = argv[0], argv[1:]
    if kind not in KINDS:
        raise SystemExit(f"error: unknown plot {kind!r}; choose from: {', '.join(KINDS)} "
                         "(attnzoo-plot KIND --help)")
    module = importlib.import_module(f"{__package__}.{KINDS[kind][0]}")
    module.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
