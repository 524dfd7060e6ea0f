"""Offline tests of scripts/data/prepare_libreoffice.py and scripts/data/prepare_enwik8.py on tiny
inputs."""
import json
import os
import shutil

import pytest
from scripts.data import prepare_enwik8 as ew
from scripts.data import prepare_libreoffice as lo


PAGE = """<!DOCTYPE html><html><head><title>T</title><script>var x = "<p id='par_id9'>no</p>";</script>
</head><body><p id="bm_module">boilerplate</p><div id="DisplayArea">
<a name="bm_id1"></a>
<h1 id="hd_id1" dir="auto">{h}</h1>
<p id="par_id1" class="paragraph">{p1}</p>
<p id="par_id2">{p2}</p>
<div class="embedded"><p id="par_id77">copied from another page</p></div>
{extra}
</div></body></html>"""


def page(h="Title", p1="one", p2="two", extra=""):
    return PAGE.format(h=h, p1=p1, p2=p2, extra=extra)


# ------------------------------------------------------------------ HTML extraction
def test_extract_nested_markup_entities_and_switches():
    html = page(
        h="Find &amp; Replace",
        p1='Press <span id="swlnsys1" class="switchinline"><span hidden="true" id="MACtext1" '
           'class="MAC"><span class="keycode">Command</span></span><span hidden="true" '
           'id="defaulttext1"><span class="keycode">Ctrl</span></span></span><span '
           'class="keycode"> + F</span> to <a href="x.html">open <em>the</em>\n   bar</a>&nbsp;now.',
        p2="a&lt;b &#x263A; c<br>d<img src='x.png' alt='icon'>e",
    )
    got = lo.extract_paragraphs(html)
    assert got["hd_id1"] == "Find & Replace"
    assert got["par_id1"] == "Press Ctrl + F to open the bar now."
    assert got["par_id2"] == "a<b \u263a c de"  # <br> separates, an inline <img> does not
    assert "bm_module" not in got and "par_id9" not in got  # boilerplate id / script text
    assert "par_id77" not in got  # embedded copy of another page is skipped
    assert "par_id77" in lo.extract_paragraphs(html, skip_embedded=False)


def test_extract_repeated_ids_numbered_and_other_ids_ignored():
    html = page(extra='<h2 id="hd_id1">Again</h2><p id="other">x</p><p id="par_123">old style</p>'
                      '<h id="par_idN1">odd tag</h>')
    got = lo.extract_paragraphs(html)
    assert got["hd_id1"] == "Title" and got["hd_id1#2"] == "Again"
    assert got["par_123"] == "old style" and got["par_idN1"] == "odd tag"
    assert "other" not in got


# ------------------------------------------------------------------ alignment
def _tree(root, files):
    for rel, html in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(html, encoding="utf-8")


def test_align_dirs_by_file_and_id(tmp_path):
    de, en = tmp_path / "de", tmp_path / "en"
    _tree(de, {
        "a/x.html": page("Titel", "eins", "zwei", '<p id="par_id5">nur deutsch</p>'),
        "b/y.html": page("Y", "drei", "vier", '<h2 id="hd_id9">A</h2><h2 id="hd_id9">B</h2>'),
        "de_only.html": page(),
    })
    _tree(en, {
        "a/x.html": page("Title", "one", "two", '<p id="par_id6">english only</p>'),
        "b/y.html": page("Y", "three", "four", '<h2 id="hd_id9">A</h2>'),  # count mismatch
        "en_only.html": page(),
    })
    stats = {}
    pairs = lo.align_dirs(de, en, stats=stats)
    assert pairs[:3] == [("a/x.html", "hd_id1", "Titel", "Title"),
                         ("a/x.html", "par_id1", "eins", "one"),
                         ("a/x.html", "par_id2", "zwei", "two")]
    keys = {(r, k) for r, k, _, _ in pairs}
    assert ("a/x.html", "par_id5") not in keys and ("a/x.html", "par_id6") not in keys
    assert not any(k.startswith("hd_id9") for _, k in keys)  # repeated id with differing count
    assert not any(r in ("de_only.html", "en_only.html") for r, _ in keys)
    assert stats["files_common"] == 2 and stats["files_a_only"] == 1


def test_filter_pairs():
    pairs = [("f", "1", "", "x y z"), ("f", "2", "a b", "c d e"), ("f", "3", "a b c", "a b c"),
             ("f", "4", "ein zwei drei", "one two three"), ("g", "5", "ein zwei drei", "one two three"),
             ("f", "6", " ".join(["w"] * 51), "x y z")]
    stats = {}
    out = lo.filter_pairs(pairs, 3, 50, stats=stats)
    assert out == [("f", "4", "ein zwei drei", "one two three")]
    assert stats == {"dropped_empty": 1, "dropped_length": 2, "dropped_untranslated": 1,
                     "dropped_duplicate": 1}


# ------------------------------------------------------------------ split by file
def _synthetic_pairs(n_files=200):
    pairs = []
    for f in range(n_files):
        for i in range(1 + f % 7):
            pairs.append((f"mod{f % 5}/file{f}.html", f"par_id{i}", f"de {f} {i}", f"en {f} {i}"))
    return pairs


def test_split_by_file_disjoint_and_deterministic():
    pairs = _synthetic_pairs()
    train, valid, test = lo.split_by_file(pairs, 0.05, 0.05, seed=3, min_heldout=10)
    files = [{p[0] for p in s} for s in (train, valid, test)]
    assert not (files[0] & files[1]) and not (files[0] & files[2]) and not (files[1] & files[2])
    assert len(train) + len(valid) + len(test) == len(pairs)
    assert len(valid) >= 0.05 * len(pairs) and len(test) >= 0.05 * len(pairs)
    assert len(train) > 0.8 * len(pairs)
    again = lo.split_by_file(list(reversed(pairs)), 0.05, 0.05, seed=3, min_heldout=10)
    assert [{p[0] for p in s} for s in again] == files  # order of input does not matter
    other = lo.split_by_file(pairs, 0.05, 0.05, seed=4, min_heldout=10)
    assert [{p[0] for p in s} for s in other] != files


def test_split_min_heldout_and_overlap_removal():
    pairs = _synthetic_pairs()
    n = len(pairs)
    _, valid, test = lo.split_by_file(pairs, 0.01, 0.01, seed=1, min_heldout=1000)
    assert min(len(valid), len(test)) >= n / 10  # min_heldout capped at 10% of the corpus
    train = [("t", "1", "same source", "x")]
    valid = [("v", "1", "same source", "y"), ("v", "2", "new", "z")]
    test = [("w", "1", "new", "q"), ("w", "2", "newer", "r")]
    _, v2, t2 = lo.remove_overlap(train, valid, test)
    assert v2 == [("v", "2", "new", "z")] and t2 == [("w", "2", "newer", "r")]


# ------------------------------------------------------------------ error path
def test_missing_apt_get_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    rc = lo.main(["--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"),
                  "--skip-binarize"])
    err = capsys.readouterr().err
    assert rc != 0
    assert len(err.strip().splitlines()) == 1
    assert "apt-get" in err and "--debs" in err


def test_debs_dir_without_packages_errors(tmp_path, capsys):
    (tmp_path / "debs").mkdir()
    rc = lo.main(["--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"),
                  "--debs", str(tmp_path / "debs"), "--skip-binarize"])
    err = capsys.readouterr().err
    assert rc != 0 and len(err.strip().splitlines()) == 1 and "libreoffice-help-de" in err


# ------------------------------------------------------------------ end to end (sentencepiece)
def _fake_help_tree(root, n_files=60):
    words_de = "der die das Datei Zelle Tabelle öffnen wählen Menü Format Ansicht Text".split()
    words_en = "the a an file cell table open choose menu format view text".split()
    help_dir = root / "usr/share/libreoffice/help"
    for lang, words in (("de", words_de), ("en-US", words_en)):
        files = {}
        for f in range(n_files):
            paras = "".join(
                f'<p id="par_id{f}{i}">' + " ".join(words[(f * 7 + i * 3 + k) % len(words)]
                                                    for k in range(3 + (f + i) % 6)) + f" {f} {i}</p>"
                for i in range(8))
            files[f"mod{f % 3}/page{f}.html"] = f"<html><body>{paras}</body></html>"
        _tree(help_dir / lang / "text", files)


def test_libreoffice_end_to_end_tiny(tmp_path, capsys):
    pytest.importorskip("sentencepiece")
    _fake_help_tree(tmp_path / "tree")
    out = tmp_path / "out"
    argv = ["--out", str(out), "--cache", str(tmp_path / "cache"), "--debs", str(tmp_path / "tree"),
            "--vocab-size", "60", "--skip-binarize", "--min-heldout", "20"]
    assert lo.main(argv) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert sum(stats["pairs"].values()) == 60 * 8
    for split in ("train", "valid", "test"):
        de = (out / "raw" / f"{split}.de").read_text().splitlines()
        en = (out / "spm" / f"{split}.en").read_text().splitlines()
        assert len(de) == len(en) == stats["pairs"][split] > 0
    assert "\u2581" in (out / "spm" / "train.en").read_text()
    capsys.readouterr()
    assert lo.main(argv) == 0 and "cached" in capsys.readouterr().out
    # reverse direction works too
    rev = argv[:1] + [str(tmp_path / "rev")] + argv[2:] + ["--src", "en", "--tgt", "de"]
    assert lo.main(rev) == 0
    assert (tmp_path / "rev" / "spm" / "test.de").exists()


@pytest.mark.slow
def test_libreoffice_binarize_tiny(tmp_path, preprocess_through_server):
    """Full pipeline incl. fairseq-preprocess on a tiny synthetic help tree."""
    pytest.importorskip("sentencepiece")
    pytest.importorskip("fairseq")
    _fake_help_tree(tmp_path / "tree", n_files=30)
    out = tmp_path / "out"
    assert lo.main(["--out", str(out), "--cache", str(tmp_path / "c"), "--debs",
                    str(tmp_path / "tree"), "--vocab-size", "60", "--min-heldout", "10"]) == 0
    names = {p.name for p in (out / "bin").iterdir()}
    assert {"dict.de.txt", "dict.en.txt", "train.de-en.de.bin", "test.de-en.en.idx"} <= names


# ------------------------------------------------------------------ enwik8
def test_split_bytes_sizes():
    data = bytes(range(256)) * 3 + bytes(232)  # 1000 bytes
    tr, va, te = ew.split_bytes(data)
    assert (len(tr), len(va), len(te)) == (900, 50, 50)
    assert tr + va + te == data
    assert [len(x) for x in ew.split_bytes(b"x" * 1001)] == [901, 50, 50]
    with pytest.raises(ValueError):
        ew.split_bytes(data, (0.5, 0.2, 0.2))


def test_split_bytes_enwik8_rule():
    # 10^8 "bytes" without allocating them: split_bytes only needs len() and slicing
    tr, va, te = ew.split_bytes(range(ew.ENWIK8_SIZE))
    assert (len(tr), len(va), len(te)) == (90_000_000, 5_000_000, 5_000_000)
    assert (tr[-1], va[0], te[0]) == (89_999_999, 90_000_000, 95_000_000)


def test_bytes_to_lines_round_trip():
    data = "Zürich <page>\n\n  x\t&amp;\n".encode("utf-8") + bytes([0, 255, 10, 13, 32])
    lines = ew.bytes_to_lines(data)
    assert len(lines) == data.count(b"\n") + 1
    assert lines[0] == " ".join(str(b) for b in "Zürich <page>".encode("utf-8"))
    assert lines[1] == "" and "10" not in " ".join(lines).split()
    assert b"\n".join(bytes(map(int, line.split())) for line in lines) == data
    lines_nl = ew.bytes_to_lines(data, newline_token=True)
    assert all(line.split()[-1] == "10" for line in lines_nl[:-1])
    assert b"".join(bytes(map(int, line.split())) for line in lines_nl) == data
    assert ew.bytes_to_lines(b"ab\n") == ["97 98", ""]


def test_enwik8_text_files_from_xml(tmp_path):
    import bz2
    xml = b"<mediawiki>\n" + b"<page><title>A</title><text>Some words here.</text></page>\n" * 40
    src = tmp_path / "dump.xml.bz2"
    src.write_bytes(bz2.compress(xml))
    out = tmp_path / "out"
    assert ew.main(["--xml", str(src), "--out", str(out), "--skip-binarize"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert sum(stats["bytes"].values()) == len(xml)
    rebuilt = b""
    for split in ("train", "valid", "test"):
        text = (out / f"{split}.txt").read_text()
        part = b"\n".join(bytes(map(int, line.split())) for line in text.split("\n"))
        assert part == (out / f"{split}.txt.raw").read_bytes()
        rebuilt += part
    assert rebuilt == xml
    assert ew.main(["--xml", str(src), "--out", str(out), "--skip-binarize"]) == 0  # cached
    assert ew.main(["--xml", str(src), "--out", str(tmp_path / "o2"), "--max-bytes", "100",
                    "--skip-binarize"]) == 0
    assert json.loads((tmp_path / "o2" / "stats.json").read_text())["bytes"] == {
        "train": 90, "valid": 5, "test": 5}


def test_enwik8_missing_zip_error(tmp_path, capsys):
    rc = ew.main(["--zip", str(tmp_path / "nope.zip"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc != 0 and len(err.strip().splitlines()) == 1 and "--download" in err


def test_enwik8_zip_source(tmp_path, capsys):
    import zipfile
    data = bytes((i * 37) % 256 for i in range(1000))
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as z:
        z.writestr("enwik8", data)
    out = tmp_path / "out"
    assert ew.main(["--zip", str(tmp_path / "enwik8.zip"), "--out", str(out),
                    "--skip-binarize"]) == 0
    assert "expected 100000000" in capsys.readouterr().err  # size warning for a non-enwik8 file
    assert (out / "test.txt.raw").read_bytes() == data[950:]
    assert json.loads((out / "stats.json").read_text())["bytes"] == {
        "train": 900, "valid": 50, "test": 50}
