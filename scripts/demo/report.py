#!/usr/bin/env python
"""The demo's picture report: ``README.md`` with one PNG per trained row (in the run's
``work/demo/report``; ``make demo DEMO_ARGS=--publish`` writes the tracked ``docs/demo``), drawn
by the plotters of ``attnzoo-plot`` (fairseq_attnzoo/cli/) from the demo's own checkpoints
(``make demo`` writes it after its table).

=======================================  =======================================================
row                                      picture (plotter)
=======================================  =======================================================
adaptive-span / All-Attention LM         learned span per layer and head (plot_spans)
transformer_pkm                          slot usage over the product-key grid (plot_pkm_usage)
transformer_synth_*                      synthesized self-attention next to the vanilla
                                         model's dot-product attention on one test sentence, and
                                         the logged mixture weights (plot_synthesizer)
collab_convert* / transformer_collab*    QK energy spectrum before / after (plot_qk_spectrum)
=======================================  =======================================================

Rows without a method picture (the vanilla baseline, AOP) are listed with their scores only.
Regenerate from an earlier run's checkpoints without training::

    python -m scripts.demo.report --out work/demo        # reads work/demo/results.json
"""

import argparse
import json
import logging
import os
from typing import Dict, List, Optional

from fairseq_attnzoo.cli import command
from scripts.demo import config
from scripts.demo.config import REPO

PKM_MAX_BATCHES = 50  # valid batches of --max-tokens 4096 the usage is measured on
SENTENCE_MAX_TOKENS = 20  # the synthesizer picture uses the first test sentence this short


class DemoRow:
    """Where a demo row's files are: ``out/<name>/`` as written by scripts/demo/demo.py."""

    def __init__(self, name: str, spec: dict, result: dict, out: str, lm: bool):
        self.name, self.spec, self.result, self.lm = name, spec, result, lm
        self.dir = os.path.join(out, name)
        self.arch = spec.get("arch", name)
        self.convert = "convert" in spec
        self.parent = spec.get("from")
        self.ckpt = (os.path.join(self.dir, "converted.pt") if self.convert
                     else os.path.join(self.dir, "checkpoints", "checkpoint_last.pt"))
        self.train_log = os.path.join(self.dir, "train.log")

    def kind(self) -> Optional[str]:
        if self.lm:
            return "spans"
        if self.convert or self.arch.startswith("transformer_collab"):
            return "spectrum"
        if self.arch.startswith("transformer_pkm"):
            return "pkm"
        if self.arch.startswith("transformer_synth"):
            return "synth"
        return None


def _score_line(row: DemoRow) -> str:
    r = row.result
    if row.lm:
        return f"valid bpc {r['bpc']:.3f}"
    return f"BLEU {r['bleu']:.2f}, chrF {r['chrf']:.2f}"


# ---- one picture per kind ---------------------------------------------------------------------

def spans_picture(row: DemoRow, docs: str) -> str:
    from fairseq_attnzoo.cli import plot_spans

    s, r, spans = plot_spans.load_spans(row.ckpt)
    png = plot_spans.plot_spans(s, r, spans, os.path.join(docs, f"{row.name}_spans.png"),
                                f"{row.name}: learned span per head (S = {s})")
    layers = ", ".join(f"{i}: mean {float(z.mean()):.0f} / max {float(z.max()):.0f}"
                       for i, z in enumerate(spans))
    return _md(png, docs, f"Learned attention span z per layer and head (positions; maximum "
                          f"S = {s}, ramp R = {r}). Per layer: {layers}.")


def pkm_picture(row: DemoRow, docs: str, data: str) -> str:
    from fairseq_attnzoo.cli import plot_pkm_usage
    from fairseq_attnzoo.modules.pkm import usage_stats

    model, task = plot_pkm_usage.load(row.ckpt, data, os.path.join(REPO, "fairseq_attnzoo"), True)
    counts, mems, tokens = plot_pkm_usage.collect(model, task, "valid", 4096, PKM_MAX_BATCHES)
    png = os.path.join(docs, f"{row.name}_usage.png")
    plot_pkm_usage.plot(counts, mems, png)
    stats = "; ".join(f"{name}: usage {u:.1%} of {z.numel():,} slots, KL {kl:.2f}"
                      for name, z in counts.items() for u, kl in [usage_stats(z)])
    return _md(png, docs, f"Memory slot weights over {tokens:,} valid tokens: histogram of the "
                          f"used slots' weights and the weight of every slot on the product-key "
                          f"grid. {stats}.")


def _first_short_example(task, split: str = "test"):
    task.load_dataset(split)
    ds = task.dataset(split)
    for i in range(len(ds)):
        item = ds[i]
        if len(item["source"]) <= SENTENCE_MAX_TOKENS and len(item["target"]) <= SENTENCE_MAX_TOKENS:
            return item
    return ds[0]


def synth_pictures(row: DemoRow, docs: str, data: str, vanilla: Optional[DemoRow]) -> str:
    from fairseq_attnzoo.cli import plot_synthesizer as psa

    from fairseq_attnzoo.models.synthesizer import mixture_weights

    model, cfg, task = psa.load(row.ckpt, data)
    item = _first_short_example(task)
    src, tgt = item["source"], item["target"]
    labels = [task.source_dictionary[i] for i in src]
    synth = psa.run(model, task, src, tgt)["encoder"]
    parts = []
    if vanilla is not None and os.path.exists(vanilla.ckpt):
        vmodel, _, vtask = psa.load(vanilla.ckpt, data)
        van = psa.run(vmodel, vtask, src, tgt)["encoder"]
        png = os.path.join(docs, f"{row.name}_attention.png")
        psa.plot_compare(synth, van, labels, labels, "encoder", png)
        parts.append(_md(png, docs, f"Encoder self-attention on the test sentence "
                                    f"\"{' '.join(labels[:-1])}\" (head average per layer): the "
                                    f"synthesized weights (left) next to the dot-product attention "
                                    f"of `{vanilla.name}` (right)."))
    else:
        png = os.path.join(docs, f"{row.name}_attention.png")
        psa.plot_grid(synth, labels, labels, f"{row.name}: synthesized encoder self-attention", png)
        parts.append(_md(png, docs, f"Synthesized encoder self-attention per layer and head on "
                                    f"\"{' '.join(labels[:-1])}\"."))
    curves = psa.mixture_log(row.train_log) if os.path.exists(row.train_log) else {}
    if curves:
        png = psa.plot_mixture_log(curves, os.path.join(docs, f"{row.name}_mixture.png"),
                                   f"{row.name}: mixture weights while training")
        final = ", ".join(f"{n}: " + "/".join(f"{c} {a:.2f}" for c, a in w.items())
                          for n, w in mixture_weights(model))
        parts.append(_md(png, docs, f"Mixture weight of the first component per layer, as logged "
                                    f"during training. Final weights: {final}."))
    return "\n\n".join(parts)


def spectrum_picture(row: DemoRow, docs: str, parent: Optional[DemoRow]) -> str:
    from fairseq_attnzoo.cli import plot_qk_spectrum as qk

    after = qk.load_curves(row.ckpt)
    panels = []
    if parent is not None and os.path.exists(parent.ckpt):
        before = qk.load_curves(parent.ckpt)
        panels.append((f"before: {parent.name}", before))
    panels.append((f"after: {row.name}" if panels else row.name, after))
    png = qk.plot_panels(panels, os.path.join(docs, f"{row.name}_spectrum.png"))

    def pcs(curves):
        return sum(qk.components_for(c, 0.9) for c, _ in curves.values()) / max(1, len(curves))

    text = ("Captured energy of the concatenated key/query products W_Q,i W_K,iᵀ against the "
            "number of principal components, one curve per attention layer")
    if len(panels) == 2:
        text += (f": before the conversion (left) and after (right). Components for 90% of the "
                 f"energy, mean over layers: {pcs(panels[0][1]):.1f} before, "
                 f"{pcs(after):.1f} after.")
    else:
        text += f". Components for 90% of the energy, mean over layers: {pcs(after):.1f}."
    return _md(png, docs, text)


def _md(png: str, docs: str, caption: str) -> str:
    rel = os.path.relpath(png, docs)
    return f"![{os.path.splitext(rel)[0]}]({rel})\n\n{caption}"


# ---- the report -------------------------------------------------------------------------------

@command  # it loads our checkpoints through fairseq: the compat table first
def write_report(rows: List[DemoRow], docs: str, data: str, command: str) -> str:
    """Draw every row's picture into ``docs`` and write ``docs/README.md``; returns its path."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    os.makedirs(docs, exist_ok=True)
    by_name = {r.name: r for r in rows}
    vanilla = next((r for r in rows if r.arch in ("transformer", "attnzoo_transformer")
                    and not r.parent and not r.convert), None)
    lines = ["# Demo report: what the methods learned", "",
             f"Pictures from the checkpoints of one `{command}` run, drawn by the plotters of "
             "`attnzoo-plot` (`scripts/demo/report.py` calls them; "
             "`python -m scripts.demo.report --out work/demo` redraws them without training). "
             "Scores and timings: [docs/demo_results.md](../demo_results.md).", ""]
    for row in rows:
        kind = row.kind()
        lines += [f"## {row.name}", "", f"{row.spec.get('notes', '')} — {_score_line(row)}.", ""]
        if kind == "spans":
            lines.append(spans_picture(row, docs))
        elif kind == "pkm":
            lines.append(pkm_picture(row, docs, data))
        elif kind == "synth":
            lines.append(synth_pictures(row, docs, data, vanilla))
        elif kind == "spectrum":
            lines.append(spectrum_picture(row, docs, by_name.get(row.parent)))
        elif row.arch in ("transformer", "attnzoo_transformer"):
            lines.append("The baseline: no method of its own to picture; its dot-product attention "
                         "and its QK spectrum appear next to the Synthesizer and collaborative "
                         "rows.")
        else:
            lines.append("No picture: `attnzoo-plot` has no plotter for this method yet.")
        lines.append("")
    path = os.path.join(docs, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def demo_rows(out: str, names: List[str], results: Dict[str, dict]) -> List[DemoRow]:
    mt, lms = config.mt_rows(), config.lm_rows()
    rows = []
    for name in names:
        lm = name in lms
        spec = lms[name] if lm else mt[name]
        rows.append(DemoRow(name, spec, results[name], out, lm))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "work/demo"),
                   help="the demo's working directory (results.json, one folder per row)")
    p.add_argument("--docs", default=None, help="report folder (default OUT/report; "
                   "docs/demo is the tracked one `make demo DEMO_ARGS=--publish` writes)")
    p.add_argument("--data", default=os.path.join(REPO, "data/libreoffice/bin"))
    a = p.parse_args(argv)
    a.docs = os.path.join(a.out, "report") if a.docs is None else a.docs
    try:
        with open(os.path.join(a.out, "results.json")) as f:
            results = {r["arch"]: r for r in json.load(f)}
    except (OSError, ValueError) as e:
        raise SystemExit(f"no demo results in {a.out} ({type(e).__name__}): run `make demo` first "
                         "or pass --out DIR")
    rows = demo_rows(a.out, list(results), results)
    mt = [r.name for r in rows if not r.lm]
    lm = [r.name for r in rows if r.lm]
    path = write_report(rows, a.docs, a.data, config.make_command(mt, lm))
    print(f"report written to {path}")


if __name__ == "__main__":
    main()
