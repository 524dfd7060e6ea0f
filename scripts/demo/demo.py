#!/usr/bin/env python
"""Offline demo (``make demo``, or ``python -m scripts.demo.demo`` from the repository root): train
small models of each arch on the LibreOffice help German->English corpus
with the stock fairseq CLIs, decode the test set with beam search and print a results table
(arch, params, train words/s, BLEU and chrF with sacrebleu), then draw each row's method picture
into a report (docs/demo/README.md, scripts/demo/report.py). Run through ``make demo``.

Every arch gets the same model size and the same update budget (``--max-update``), so the table
compares architectures, not budgets. Derived rows (a converted checkpoint, a fine-tune) start from
the checkpoint of the row they name in ``"from"`` (``DERIVED`` in scripts/demo/config.py, which
also holds the demo size and each method's flags; the arch rows come from the registry).

Rows run two at a time on two cores (``--jobs``; each fairseq process gets one thread: two
one-thread trainings do ~1.55x the work of one two-thread training here, docs/demo.md), so every
row's words/s is measured next to one other running row. Each row's commands are fingerprinted in
``work/demo/ARCH/row.json``; a later ``make demo`` with an identical row (same commands, same
parent row) reuses its checkpoint and scores instead of retraining (``--rerun`` retrains).
"""

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from scripts.bench.tables import format_table as markdown
from scripts.demo.config import (LM_DATA, REPO, USER_DIR, fairseq_bin, lm_cmd, lm_rows,
                                 make_command, mt_rows, train_cmd)

DEFAULT_LM_ARCHS = ["adaptive_span_lm_small"]  # all_attention_lm via LM_ARCHS

# the baseline plus one representative of each method (collaborative heads: the baseline converted
# to half the key dimension; the from-scratch and fine-tuned rows via ARCHS, docs/collab.md), the
# slowest row first so that the two job slots finish together (1,060 s measured on 2 cores)
DEFAULT_ARCHS = ["transformer_pkm", "transformer", "collab_convert64", "transformer_synth_random",
                 "transformer_aop"]
DEFAULT_MAX_UPDATE = 1500


_PRINT = threading.Lock()
_PROCS = set()  # running subprocesses, terminated if another job fails


def say(tag, msg):
    with _PRINT:
        print(f"[{tag}] {msg}" if tag else msg, flush=True)


def progress(line):
    """A short progress line from fairseq's json log line (or the line itself)."""
    try:
        stats = json.loads(line[line.index("{"):])
    except ValueError:
        return line.rstrip()[-150:]
    keys = ("num_updates", "loss", "valid_loss", "valid_ppl", "valid_bpc", "ppl", "bpc", "wps",
            "valid_num_updates")
    kind = "valid" if "valid_loss" in stats else "train"
    return kind + " " + " ".join(f"{k.replace('valid_', '')} {stats[k]}" for k in keys
                                 if k in stats)


def sh(cmd, log_path, tag, threads, echo=True):
    """Run a command with ``threads`` intra-op threads, stream fairseq's progress lines (prefixed
    with the row name: rows run side by side) and keep the whole output in log_path."""
    say(tag, "$ " + " ".join(shlex.quote(c) for c in cmd))
    lines = []
    # fairseq's progress must stream, not buffer
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
    with open(log_path, "w") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env=env) as p:
        _PROCS.add(p)
        try:
            for line in p.stdout:
                log.write(line)
                lines.append(line.rstrip("\n"))
                if echo and ("train_inner" in line or "| valid |" in line or "Error" in line
                             or "error" in line or "done training" in line):
                    say(tag, progress(line))
            p.wait()
        finally:
            _PROCS.discard(p)
    if p.returncode != 0:
        tail = "\n".join(lines[-30:])
        raise SystemExit(f"[{tag}] command failed (exit {p.returncode}), see {log_path}:\n{tail}")
    return lines


def generate_cmd(ckpt, data, beam):
    return [fairseq_bin("fairseq-generate"), data, "--user-dir", USER_DIR, "--path", ckpt,
            "--gen-subset", "test", "--beam", str(beam), "--batch-size", "64",
            "--remove-bpe", "sentencepiece", "--cpu", "--max-len-a", "1.2", "--max-len-b", "10",
            "--required-batch-size-multiple", "1"]


def parse_train(lines):
    """(all parameters, memory parameters, train words/s) from fairseq-train's log. fairseq logs
    the shared parameters and the expert-tagged ones (product-key memory value tables) on two
    lines; the model has their sum."""
    counts, wps = {}, None
    for line in lines:
        m = re.search(r"num\. (shared|expert) model params: ([\d,]+)", line)
        if m:
            counts[m.group(1)] = int(m.group(2).replace(",", ""))
        if '"train_wps"' in line:
            wps = float(json.loads(line[line.index("{"):])["train_wps"])
    if "shared" not in counts:
        return None, None, wps
    return counts["shared"] + counts.get("expert", 0), counts.get("expert", 0), wps


def score(lines, data, out_dir):
    """sacrebleu BLEU/chrF of fairseq-generate's D- lines against its T- lines; every test
    sentence must have been translated (nothing silently skipped)."""
    import sacrebleu

    hyps, refs = {}, {}
    for line in lines:
        if line.startswith("D-"):
            idx, _, text = line[2:].split("\t", 2)
            hyps[int(idx)] = text
        elif line.startswith("T-"):
            idx, text = line[2:].split("\t", 1)
            refs[int(idx)] = text
    ids = sorted(refs)
    expected = _test_size(data)
    if not ids or set(ids) != set(hyps) or (expected is not None and len(ids) != expected):
        raise SystemExit(f"fairseq-generate translated {len(hyps)} of {expected} test sentences: "
                         f"see {out_dir}/generate.log")
    sys_out = [hyps[i] for i in ids]
    ref = [refs[i] for i in ids]
    with open(os.path.join(out_dir, "test.hyp"), "w") as f:
        f.write("\n".join(sys_out) + "\n")
    return (sacrebleu.corpus_bleu(sys_out, [ref]).score, sacrebleu.corpus_chrf(sys_out, [ref]).score,
            len(ids))


def _test_size(data):
    """Number of test sentences in the binarised corpus (so no sentence is silently skipped)."""
    idx = os.path.join(data, "test.de-en.de.idx")
    if not os.path.exists(idx):
        return None
    import logging

    from fairseq.data import data_utils

    logging.getLogger("fairseq.data.data_utils").setLevel(logging.WARNING)
    return len(data_utils.load_indexed_dataset(idx[:-4], None))


class Row:
    """One table row: train (or convert, or fine-tune) then decode and score. ``key`` fingerprints
    every command of the row and of the row it derives from, so an identical earlier run is
    reused instead of retrained (``--rerun`` forces a fresh one)."""

    def __init__(self, name, spec, a, lm=False):
        self.name, self.spec, self.a, self.lm = name, dict(spec), a, lm
        self.dir = os.path.join(a.out, name)
        self.save = os.path.join(self.dir, "checkpoints")
        self.parent = spec.get("from")

    def commands(self, parent):
        a, spec = self.a, self.spec
        if self.lm:
            return [lm_cmd(self.name, spec, self.save, a.lm_max_update, a.seed)], None
        if "convert" in spec:
            ckpt = os.path.join(self.dir, "converted.pt")
            conv = [sys.executable] + [c.format(src=parent.ckpt, out=ckpt)
                                       for c in shlex.split(spec["convert"])]
            return [conv, generate_cmd(ckpt, a.data, a.beam)], ckpt
        ckpt = os.path.join(self.save, "checkpoint_last.pt")
        train = train_cmd(self.name, spec, a.data, self.save, spec.get("max_update", a.max_update),
                          a.seed, restore=parent.ckpt if parent else None)
        return [train, generate_cmd(ckpt, a.data, a.beam)], ckpt

    def prepare(self, parent):
        self.cmds, self.ckpt = self.commands(parent)
        blob = json.dumps([self.cmds, parent.key if parent else None])
        self.key = hashlib.sha1(blob.encode()).hexdigest()

    def cached(self):
        try:
            with open(os.path.join(self.dir, "row.json")) as f:
                old = json.load(f)
        except (OSError, ValueError):
            return None
        if old.get("key") != self.key or (self.ckpt and not os.path.exists(self.ckpt)):
            return None
        return old["row"]

    def run(self, threads):
        shutil.rmtree(self.dir, ignore_errors=True)  # else fairseq-train resumes an old run
        os.makedirs(self.save)
        row = {"arch": self.name, "notes": self.spec.get("notes", "")}
        t0 = time.time()
        lines = sh(self.cmds[0], os.path.join(self.dir, "convert.log" if "convert" in self.spec
                                              else "train.log"), self.name, threads)
        row["train_s"] = time.time() - t0
        if "convert" in self.spec:
            row["params"] = next((int(m.group(1).replace(",", "")) for m in
                                  (re.search(r"converted model params: ([\d,]+)", x) for x in lines)
                                  if m), None)
        else:
            row["params"], row["memory_params"], row["wps"] = parse_train(lines)
        if self.lm:
            bpc = [float(json.loads(x[x.index("{"):])["valid_bpc"]) for x in lines
                   if '"valid_bpc"' in x]
            if not bpc:
                raise SystemExit(f"[{self.name}] no valid bpc in {self.dir}/train.log")
            row["bpc"] = bpc[-1]
            say(self.name, f"--> valid bpc {row['bpc']:.3f}")
        else:
            t0 = time.time()
            gen = sh(self.cmds[1], os.path.join(self.dir, "generate.log"), self.name, threads,
                     echo=False)
            row["generate_s"] = time.time() - t0
            row["bleu"], row["chrf"], n = score(gen, self.a.data, self.dir)
            say(self.name, f"--> BLEU {row['bleu']:.2f} chrF {row['chrf']:.2f} on {n} test "
                           "sentences")
        with open(os.path.join(self.dir, "row.json"), "w") as f:
            json.dump({"key": self.key, "row": row, "commands": self.cmds}, f, indent=1)
        return row


def run_rows(rows, jobs, threads, rerun):
    """Run the rows ``jobs`` at a time (a derived row waits for the row it starts from); each
    job's processes get ``threads`` intra-op threads. Returns {name: result row}."""
    by_name = {r.name: r for r in rows}
    pending, running, done, reused = list(rows), {}, {}, []
    try:
        with ThreadPoolExecutor(max_workers=jobs) as ex:
            while pending or running:
                for r in list(pending):
                    if r.parent and r.parent not in done:
                        continue
                    r.prepare(by_name[r.parent] if r.parent else None)
                    old = None if rerun else r.cached()
                    if old is not None:  # needs no job slot
                        pending.remove(r)
                        say(r.name, f"reusing the results of an identical earlier run "
                                    f"({r.dir}/row.json; --rerun retrains)")
                        done[r.name] = old
                        reused.append(r.name)
                        continue
                    if len(running) >= jobs:
                        continue
                    pending.remove(r)
                    say(r.name, "started")
                    running[ex.submit(r.run, threads)] = r
                if not running:
                    continue
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    done[running.pop(fut).name] = fut.result()  # a failed row raises here
    except BaseException:
        for p in list(_PROCS):  # do not leave the other row's fairseq-train behind
            p.terminate()
        raise
    return done, reused


def _count(r, key, spec):
    return format(r[key], spec) if r.get(key) else ""


def format_table(rows):
    return markdown([{"arch": r["arch"], "params": _count(r, "params", ","),
                      "of which memory": _count(r, "memory_params", ","),
                      "train words/s": _count(r, "wps", ".0f"), "train s": f"{r['train_s']:.0f}",
                      "BLEU": f"{r['bleu']:.2f}", "chrF": f"{r['chrf']:.2f}",
                      "notes": r.get("notes", "")} for r in rows])


def format_lm_table(rows, updates):
    return (f"Character LMs (gensim Wikipedia extract, enwik8 format, {updates} updates):\n\n"
            + markdown([{"arch": r["arch"], "params": _count(r, "params", ","),
                         "train tokens/s": _count(r, "wps", ".0f"),
                         "train s": f"{r['train_s']:.0f}", "valid bpc": f"{r['bpc']:.3f}",
                         "notes": r.get("notes", "")} for r in rows]))


def split_names(text):
    return [x for x in re.split(r"[,\s]+", text or "") if x and x != "none"]


#: the tracked pages ``--publish`` writes: the results table, the picture report's folder
PUBLISHED = (os.path.join(REPO, "docs/demo_results.md"), os.path.join(REPO, "docs/demo"))


def output_paths(a):
    """(results table, report folder) of a run: those given, else under ``--out`` (a run leaves
    the checkout as it was), or with ``--publish`` the tracked pages (:data:`PUBLISHED`). The
    report links ``../demo_results.md``: either way the table sits there."""
    if a.publish:
        mine = PUBLISHED
    else:
        mine = (os.path.join(a.out, "demo_results.md"), os.path.join(a.out, "report"))
    return (mine[0] if a.results is None else a.results,
            mine[1] if a.report is None else a.report)


#: where the page says how much the rows move between machines and thread layouts (measured)
SPREAD = os.path.join(REPO, "docs", "demo.md")


def spread_note(results_path: str) -> str:
    """The line under the results table: the numbers depend on the CPU and the thread layout."""
    link = os.path.relpath(SPREAD, os.path.dirname(os.path.abspath(results_path)))
    return ("These numbers depend on the CPU model and the thread layout: how much they move "
            "with the same code and data, and what holds, is in "
            f"[demo.md]({link}#how-much-the-rows-move).")


def main(argv=None):
    DEMO, LM_DEMO = mt_rows(), lm_rows()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default=" ".join(DEFAULT_ARCHS),
                   help=f"space/comma separated; known: {', '.join(DEMO)} (default: %(default)s)")
    p.add_argument("--data", default=os.path.join(REPO, "data/libreoffice/bin"))
    p.add_argument("--out", default=os.path.join(REPO, "work/demo"))
    p.add_argument("--max-update", type=int, default=DEFAULT_MAX_UPDATE,
                   help="updates per MT arch (default %(default)s)")
    p.add_argument("--lm-archs", default=" ".join(DEFAULT_LM_ARCHS),
                   help=f"character LMs (known: {', '.join(LM_DEMO)}; 'none' = no LM rows; "
                        "default: %(default)s)")
    p.add_argument("--lm-max-update", type=int, default=500)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=None,
                   help="rows trained side by side (default: 2 when OMP_NUM_THREADS >= 2, else 1); "
                        "each gets OMP_NUM_THREADS / jobs threads. On 2 cores two 1-thread jobs "
                        "do ~1.55x the work of one 2-thread job")
    p.add_argument("--rerun", action="store_true",
                   help="retrain every row even if an identical earlier run is in --out")
    p.add_argument("--results", default=None,
                   help="markdown table written here ('' = none; default OUT/demo_results.md, "
                        "with --publish the tracked docs/demo_results.md)")
    p.add_argument("--report", default=None,
                   help="picture report of the trained rows written here as README.md + PNGs "
                        "(scripts/demo/report.py; '' = none; default OUT/report, with --publish "
                        "the tracked docs/demo)")
    p.add_argument("--publish", action="store_true",
                   help="write the table and the report into the checkout's tracked pages "
                        f"({', '.join(os.path.relpath(x, REPO) for x in PUBLISHED)}) instead "
                        "of under OUT")
    a = p.parse_args(argv)
    a.results, a.report = output_paths(a)
    archs, lm_archs = split_names(a.archs), split_names(a.lm_archs)
    unknown = [x for x in archs if x not in DEMO] + [x for x in lm_archs if x not in LM_DEMO]
    if unknown:
        raise SystemExit(f"unknown demo arch(s) {unknown}; choose from: {', '.join(DEMO)} "
                         f"(MT) and {', '.join(LM_DEMO)} (--lm-archs)")
    for x in archs:
        parent = DEMO[x].get("from")
        if parent and parent not in archs[:archs.index(x)]:
            raise SystemExit(f"{x} starts from the checkpoint of {parent}: put {parent} before it "
                             f"in --archs")
    if lm_archs and not os.path.exists(os.path.join(LM_DATA, "dict.txt")):
        raise SystemExit(f"no binarised character data in {LM_DATA}: run "
                         "`make data` (python -m scripts.data.prepare_enwik8 --gensim) first")
    if archs and not os.path.exists(os.path.join(a.data, "dict.de.txt")):
        raise SystemExit(f"no binarised corpus in {a.data} (dict.de.txt missing): run "
                         "`make data` (python -m scripts.data.prepare_libreoffice) first")
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "2")))
    jobs = a.jobs or (2 if threads >= 2 else 1)
    if jobs < 1:
        raise SystemExit(f"--jobs {jobs}: must be a positive number of rows run side by side")
    per_job = max(1, threads // jobs)
    os.makedirs(a.out, exist_ok=True)
    rows = [Row(x, DEMO[x], a) for x in archs] + [Row(x, LM_DEMO[x], a, lm=True) for x in lm_archs]
    t_start = time.time()
    done, reused = run_rows(rows, jobs, per_job, a.rerun)
    total = time.time() - t_start
    mt = [done[x] for x in archs]
    table = format_table(mt) if mt else ""
    if lm_archs:
        table += ("\n" if table else "") + format_lm_table([done[x] for x in lm_archs],
                                                           a.lm_max_update)
    setting = (f"--max-update {a.max_update}, beam {a.beam}, {jobs} row(s) side by side with "
               f"OMP_NUM_THREADS={per_job} each")
    footer = f"\nTotal {total:.0f} s ({setting})."
    if reused:
        footer += (f" Reused from an earlier identical run (their times are from that run): "
                   f"{', '.join(reused)}.")
    print("\n" + table + footer)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump([done[x] for x in archs + lm_archs], f, indent=1)
    if a.results:
        os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
        with open(a.results, "w") as f:
            f.write("# Offline demo results (LibreOffice help de->en, test split)\n\n")
            f.write(f"Command: `{make_command(archs, lm_archs)}`.\n\n")
            f.write(table + footer + "\n\n" + spread_note(a.results) + "\n")
        print(f"table written to {a.results}")
    if a.report:
        from scripts.demo import report

        path = report.write_report(report.demo_rows(a.out, archs + lm_archs, done),
                                   a.report, a.data, make_command(archs, lm_archs))
        print(f"report written to {path}")


if __name__ == "__main__":
    main()
