"""The tables of docs/performance.md, generated from the benchmark records (docs/benchmarks.jsonl).

Each table sits between ``<!-- bench: PATTERN -->`` and ``<!-- /bench -->``; PATTERN names cases
(``pkm/memory-lm``, ``aop/*``). A table shows, per device and size, the latest record of every
row (a row: a kernel shape, a train precision, a quality run and seed), then the commands that
made them. ``--check`` fails when a table in the docs is not what the records give::

    python -m scripts.bench.tables            # rewrite the tables
    python -m scripts.bench.tables --check    # (a test runs this)
"""

import argparse
import fnmatch
import json
import os
import re
import sys

from scripts.bench.harness import RECORDS, REPO, kernel_env

DOCS = [os.path.join(REPO, "docs", "performance.md")]
COLUMNS = {  # the columns of each level, in order (those no row has are left out)
    "kernel": ["case", "shape", "ms", "baseline ms", "ratio", "cold ms", "baseline cold ms",
               "peak MiB", "baseline peak MiB", "GB/s", "GFLOP/s", "% roofline",
               "skipped"],
    "train": ["case", "run", "baseline precision", "precision", "baseline tokens/s", "tokens/s",
              "speed ratio", "baseline drift %", "baseline first pass tokens/s",
              "first pass tokens/s", "first pass extra s", "baseline peak GiB", "peak GiB",
              "memory ratio", "baseline sentences", "sentences", "gpus", "total tokens/s",
              "warm updates", "repeats", "floor"],
    "decode": ["case", "run", "precision", "baseline tokens/s", "tokens/s", "speed ratio",
               "baseline sentences/s", "sentences/s", "baseline drift %", "baseline peak MiB",
               "peak MiB", "memory ratio", "updates", "repeats"],
    "quality": ["case", "run", "precision", "updates", "params", "sparse value params", "valid loss",
                "mean", "valid bleu", "overflows", "usage"]}


def load(path=RECORDS):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def env_text(r) -> str:
    """The kernel-selecting environment a record ran under ("" for the defaults)."""
    return " ".join(f"{k}={v}" for k, v in kernel_env(r.get("kernel env") or {}).items())


def identity(r):
    """A row of a table: a run under another kernel environment is another row, never a
    replacement of the default one."""
    row = r["row"]
    return (r["case"], r["device"], r["size"], r.get("dtype"), env_text(r), row.get("shape"),
            row.get("run"), row.get("precision"), row.get("seed"))


def profile_lines(rows) -> str:
    """One line per profiled side: the GPU's busy share of the wall time and the top ops."""
    out = []
    for row in rows:
        for who, p in (row.get("profile") or {}).items():
            text = (f"{p['updates']} warm updates, {p['wall ms per update']:.1f} ms each"
                    + (f", GPU busy {p['busy %']:.0f} % of the wall time" if p.get("busy %")
                       is not None else "") + "; top ops by device time per update: "
                    + ", ".join(f"{op} {ms:.2f} ms" for op, _, ms, _ in p["top"][:5])
                    + ("; by host time: " + ", ".join(f"{op} {ms:.2f} ms" for op, _, ms, _ in
                                                      p["host top"][:5]) if p.get("host top")
                       else ""))
            out.append(f"- profile of the {who} (under the profiler, which slows the host): "
                       f"{text}\n")
    return "".join(dict.fromkeys(out))  # (rows of one run share its baseline's profile)


def format_table(rows, cols=None, cell=None) -> str:
    """A markdown table of dict rows: ``cols`` (default: every key, in order of appearance),
    cells by ``cell(column, value)`` (default: floats to 3 decimals, or 1 from 100 up)."""
    if not rows:
        return "(no rows)\n"
    cols = cols or list(dict.fromkeys(k for r in rows for k in r))
    cell = cell or (lambda c, v: (f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}")
                    if isinstance(v, float) else str(v))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(c, r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def fmt(key, v):
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, dict):
        return ", ".join(f"{k} {fmt(key, x)}" for k, x in v.items()) or "–"
    if isinstance(v, float):
        if "tokens/s" in key or "GB/s" in key or "FLOP/s" in key:
            return f"{v:,.0f}"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def quality_rows(records):
    """One row per (case, run, precision): the valid loss of each seed, and their mean."""
    rows = {}
    for r in records:
        key = (r["case"], r["row"]["run"], r["row"]["precision"])
        rows.setdefault(key, []).append(r)
    out = []
    for (case, run, precision), rs in rows.items():
        rs.sort(key=lambda r: r["row"]["seed"])
        losses = [r["row"]["valid loss"] for r in rs]
        first = rs[0]["row"]
        out.append({**first, "case": case, "valid loss": " / ".join(
            f"{x:.3f} (seed {r['row']['seed']})" for x, r in zip(losses, rs)),
            "mean": sum(losses) / len(losses), "overflows": sum(r["row"]["overflows"] for r in rs),
            "valid bleu": first.get("valid bleu")})
    return out


def render(pattern, records):
    chosen = [r for r in records if fnmatch.fnmatch(r["case"], pattern)]
    if not chosen:
        return (f"No records yet: `python -m scripts.bench '{pattern}'` on a device appends "
                "them.\n")
    latest = {}
    for r in chosen:  # the latest record of each row (records are appended in time order)
        latest[identity(r)] = r
    groups = {}
    for r in latest.values():
        groups.setdefault((r["device"], r["size"], r.get("dtype"), env_text(r)), []).append(r)
    out = []
    for (device, size, dtype, env), rs in sorted(groups.items()):
        level = rs[0]["level"]
        rows = (quality_rows(rs) if level == "quality"
                else [{**r["row"], "case": r["case"]} for r in rs])
        cols = [c for c in COLUMNS[level] if any(  # (a peak is "n/a" off CUDA, never dropped)
            c in row and (row[c] is not None or "peak" in c) for row in rows)]
        if len({r["case"] for r in rs}) == 1:
            cols.remove("case")
        what = f"dtype {dtype}" if level == "kernel" else f"size {size}"
        out.append(f"**{device}**, {what}" + (f", size {size}" if level == "kernel" else "")
                   + (f", environment `{env}`" if env else "") + ":\n")
        if any(row.get("suspect") for row in rows):
            out.append("**Suspect**: a baseline ran below its sanity floor (the floor column); "
                       "these ratios stand only once that is explained.\n")
        if any(row.get("noisy") for row in rows):
            out.append("**Noisy**: a baseline drifted more than the harness allows between its "
                       "first and last run; rerun before reading these ratios.\n")
        out.append(format_table(rows, cols, lambda c, v: fmt(c, v)))
        profiles = profile_lines(rows) if level == "train" else ""
        if profiles:
            out.append("\n" + profiles)
        runs = sorted({(r["run"], r["commit"], r["torch"], r["cuda"], r["command"]) for r in rs})
        out.append("\n" + "".join(f"- {run}, commit {commit}, torch {torch}, CUDA {cuda}: "
                                  f"`{command}`\n" for run, commit, torch, cuda, command in runs))
    return "\n".join(out)


def update(text, records, tag="bench", make=render):  # (scripts.costmodel: tag "costmodel")
    block = rf"(<!-- {tag}: (\S+) -->\n)(.*?)(<!-- /{tag} -->)"
    return re.sub(block, lambda m: m.group(1) + make(m.group(2), records) + m.group(4), text,
                  flags=re.S)


def main(argv=None, doc=__doc__, docs=DOCS, update=update, module="scripts.bench.tables"):
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="fail if a table differs from the records")
    p.add_argument("--records", default=RECORDS)
    p.add_argument("docs", nargs="*", default=docs)
    a = p.parse_args(argv)
    records, stale = load(a.records), []
    for path in a.docs:
        with open(path) as f:
            text = f.read()
        new = update(text, records)
        if new != text:
            if a.check:
                stale.append(path)
            else:
                with open(path, "w") as f:
                    f.write(new)
                print(f"updated {path}")
    if stale:
        print(f"tables out of date with {a.records} or the code: {', '.join(stale)}: run "
              f"`python -m {module}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
