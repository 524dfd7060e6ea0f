"""Offline tests of the WMT'14 En-De recipe: scripts/data/prepare_wmt14_en_de.py,
attnzoo-average-checkpoints and the shell scripts in examples/wmt14_en_de/."""
import io
import random
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request

import pytest
import torch
from preptest_util import ROOT

from fairseq_attnzoo.cli import average_checkpoints as avg
from scripts.data import prepare_wmt14_en_de as wmt

EXAMPLE = ROOT / "examples" / "wmt14_en_de"


EN = "the a cat dog sees big small house runs fast red blue old new man woman".split()
DE = "der ein katze hund sieht gross klein haus rennt schnell rot blau alt neu mann frau".split()


def make_corpus(n, seed):
    """n distinct word-for-word parallel pairs of 3-9 words (ratio 1)."""
    rng, pairs, seen = random.Random(seed), [], set()
    while len(pairs) < n:
        idx = tuple(rng.randrange(len(EN)) for _ in range(rng.randint(3, 9)))
        if idx not in seen:
            seen.add(idx)
            pairs.append((" ".join(EN[i] for i in idx), " ".join(DE[i] for i in idx)))
    return pairs


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


# ------------------------------------------------------------------ cleaning
def test_clean_pairs_rules_and_counts():
    src = ["a b c", "", "x y", "w " * 300, "one", "one two three four", "a  b\tc", "a b c",
           "p\u200bq r\x07s t"]
    tgt = ["d e f", "g", "   ", "v " * 10, "eins zwei", "eins", "d e f", "d e  f", "p q r"]
    pairs, stats = wmt.clean_pairs(src, tgt, max_len=250, ratio=1.5)
    # "a  b\tc" / "a b c" normalise to the first pair -> duplicates; control char -> space,
    # zero-width space removed
    assert pairs == [("a b c", "d e f"), ("pq r s t", "p q r")]
    assert stats == {"read": 9, "empty": 2, "too_long": 1, "ratio": 2, "duplicate": 2, "kept": 2}
    # 1 vs 2 words is ratio 2 > 1.5; ratio 2 allows it; max_len applies to each side
    assert wmt.clean_pairs(["one"], ["eins zwei"], ratio=2.0)[1]["kept"] == 1
    assert wmt.clean_pairs(["a b c"], ["d e f"], max_len=2)[1]["too_long"] == 1
    assert wmt.clean_pairs(["a", "a"], ["b", "b"], dedup=False)[1]["kept"] == 2
    with pytest.raises(wmt.PrepError):
        wmt.clean_pairs(["a"], [], 250, 1.5)


def test_read_lines_only_splits_on_newline(tmp_path):
    p = tmp_path / "x.txt"
    p.write_bytes("a\rb\u2028c\nd\x0be\nlast".encode("utf-8"))
    assert list(wmt.read_lines(p)) == ["a\rb\u2028c", "d\x0be", "last"]
    assert wmt.count_lines(p) == 3


def test_sgm_segments_match_sacrebleu(tmp_path):
    from sacrebleu.dataset.fake_sgml import FakeSGMLDataset

    sgm = ('<srcset setid="newstest2014" srclang="any">\n<doc sysid="ref" docid="1" '
           'genre="news" origlang="en">\n<p>\n<seg id="1">Gutach:  Noch mehr Sicherheit '
           'f\u00fcr Fu\u00dfg\u00e4nger </seg>\n<seg id="2"> A &amp; B <b>x</b></seg> \n'
           '<seg id="3">\u00a0Tabs\tand\u2009spaces</seg>\n<seg id=4>odd</seg>\n</p>\n</doc>\n')
    src, ref = tmp_path / "in.sgm", tmp_path / "ref.txt"
    src.write_text(sgm, encoding="utf-8")
    FakeSGMLDataset.__new__(FakeSGMLDataset)._convert_format(str(src), str(ref))
    expected = ref.read_text(encoding="utf-8").split("\n")[:-1]
    assert list(wmt.sgm_segments(wmt.read_lines(src))) == expected
    assert expected[0] == "Gutach: Noch mehr Sicherheit f\u00fcr Fu\u00dfg\u00e4nger"


# ------------------------------------------------------------------ end to end (--raw-dir)
@pytest.fixture(scope="module")
def raw_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("raw")
    good = make_corpus(300, seed=0)
    bad = [("", "leer"), ("empty target", ""), ("   ", "\t"),  # 3 empty
           (" ".join(["the"] * 260), " ".join(["der"] * 260)),  # 1 too long
           ("the cat", "der hund sieht ein gross rot alt haus"),  # 2 ratio
           ("the cat sees a big old red house now", "der")]
    dups = good[:5]  # 5 exact duplicates
    train = good[:150] + bad + good[150:] + dups
    write(d / "train.en", [s for s, _ in train])
    write(d / "train.de", [t for _, t in train])
    for split, seed in (("valid", 1), ("test", 2)):
        pairs = make_corpus(20, seed)
        write(d / f"{split}.en", [s for s, _ in pairs])
        # references are kept byte for byte: odd spacing must survive
        write(d / f"{split}.de", [t.replace(" ", "  ", 1) + " " for _, t in pairs])
    return d, len(train)


@pytest.mark.slow
def test_prepare_raw_dir_end_to_end(raw_corpus, tmp_path, capsys, preprocess_through_server):
    raw, n_read = raw_corpus
    out = tmp_path / "out"
    args = ["--raw-dir", str(raw), "--out", str(out), "--vocab-size", "60", "--workers", "1"]
    assert wmt.main(args) == 0
    printed = capsys.readouterr().out
    assert "empty 3, too long 1, ratio 2, duplicate 5; kept 300" in printed

    import json

    stats = json.loads((out / "stats.json").read_text())
    assert stats["clean"]["total"] == {"read": n_read, "empty": 3, "too_long": 1, "ratio": 2,
                                       "duplicate": 5, "kept": 300}
    assert stats["pairs"] == {"train": 300, "valid": 20, "test": 20}
    assert stats["binarized"] and stats["spm_vocab_size"] == 60
    assert (out / "raw" / "test.de").read_bytes() == (raw / "test.de").read_bytes()
    assert (out / "raw" / "valid.de").read_bytes() == (raw / "valid.de").read_bytes()
    assert wmt.count_lines(out / "raw" / "train.en") == 300
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            assert wmt.count_lines(out / "spm" / f"{split}.{lang}") == stats["pairs"][split]
            for ext in ("bin", "idx"):
                assert (out / "bin" / f"{split}.en-de.{lang}.{ext}").stat().st_size > 0
    dict_en = (out / "bin" / "dict.en.txt").read_text()
    assert dict_en == (out / "bin" / "dict.de.txt").read_text()  # joined dictionary
    assert len(dict_en.splitlines()) > 20

    # idempotent: a second run is a no-op
    assert wmt.main(args) == 0
    assert capsys.readouterr().out.startswith("cached")


def test_prepare_raw_dir_missing_file_is_one_line(tmp_path, capsys):
    (tmp_path / "train.en").write_text("a\n")
    assert wmt.main(["--raw-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing train.de" in err


# ------------------------------------------------------------------ --download
def test_download_failure_is_one_line(tmp_path, monkeypatch, capsys):
    def no_network(*a, **k):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    rc = wmt.main(["--download", "--cache", str(tmp_path / "cache"), "--out",
                   str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1, err
    assert "download of http://statmt.org/wmt13/training-parallel-europarl-v7.tgz failed" in err
    assert "name resolution" in err and "--raw-dir DIR" in err
    assert not list((tmp_path / "cache").glob("*.part"))


def _tgz(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_download_path_offline_with_cached_archives(tmp_path, monkeypatch, capsys):
    """Archives already in --cache: no network, only the en/de members are extracted, the three
    corpora are cleaned with one duplicate filter, test comes from the SGM files."""
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("network used"))
    cache = tmp_path / "cache"
    cache.mkdir()
    corpora = [make_corpus(40, seed=s) for s in (3, 4, 5)]
    corpora[2][:3] = corpora[0][:3]  # 3 duplicates across corpora
    for (name, url, prefix), pairs in zip(wmt.TRAIN_CORPORA, corpora):
        _tgz(cache / url.rsplit("/", 1)[-1], {
            f"{prefix}.en": "".join(s + "\n" for s, _ in pairs),
            f"{prefix}.de": "".join(t + "\n" for _, t in pairs),
            f"{prefix}.fr": "not extracted\n" * len(pairs)})
    dev = make_corpus(10, seed=6)
    _tgz(cache / "dev.tgz", {"dev/newstest2013.en": "".join(s + "\n" for s, _ in dev),
                             "dev/newstest2013.de": "".join(t + "\n" for _, t in dev)})
    test = make_corpus(7, seed=7)

    def sgm(lines):
        return "<refset>\n<doc docid=\"1\">\n" + "".join(
            f'<seg id="{i + 1}"> {x}  </seg>\n' for i, x in enumerate(lines)) + "</doc>\n"

    _tgz(cache / "test-full.tgz", {
        "test-full/newstest2014-deen-src.en.sgm": sgm([s for s, _ in test]),
        "test-full/newstest2014-deen-ref.de.sgm": sgm([t for _, t in test])})
    out = tmp_path / "out"
    assert wmt.main(["--download", "--cache", str(cache), "--out", str(out), "--vocab-size", "60",
                     "--workers", "1", "--skip-binarize"]) == 0
    printed = capsys.readouterr().out
    assert "news-commentary-v9: read 40, dropped empty 0, too long 0, ratio 0, duplicate 3" \
        in printed
    assert sorted(p.name for p in (cache / "extracted").iterdir()) == sorted(
        ["europarl-v7.de-en.en", "europarl-v7.de-en.de", "commoncrawl.de-en.en",
         "commoncrawl.de-en.de", "news-commentary-v9.de-en.en", "news-commentary-v9.de-en.de",
         "newstest2013.en", "newstest2013.de", "newstest2014-deen-src.en.sgm",
         "newstest2014-deen-ref.de.sgm"])
    assert wmt.count_lines(out / "raw" / "train.en") == 117
    assert (out / "raw" / "test.de").read_text().splitlines() == [t for _, t in test]
    assert (out / "raw" / "valid.en").read_text().splitlines() == [s for s, _ in dev]


def test_extract_members_reports_missing(tmp_path):
    _tgz(tmp_path / "a.tgz", {"x/one.en": "1\n"})
    with pytest.raises(wmt.PrepError, match="lacks x/one.de"):
        wmt.extract_members(tmp_path / "a.tgz", {"en": "x/one.en", "de": "x/one.de"},
                            tmp_path / "ex")
    (tmp_path / "b.tgz").write_bytes(b"not a tarball")
    with pytest.raises(wmt.PrepError, match="delete it and rerun"):
        wmt.extract_members(tmp_path / "b.tgz", {"en": "x/one.en"}, tmp_path / "ex2")


# ------------------------------------------------------------------ checkpoint averaging
def test_average_checkpoints(tmp_path):
    for epoch, upd, w in ((1, 900, 9.0), (1, 3000, 1.0), (2, 12000, 2.0), (3, 15000, 6.0)):
        torch.save({"model": {"w": torch.full((2,), w, dtype=torch.float16),
                              "bn.num_batches_tracked": torch.tensor(upd)},
                    "cfg": {"x": 1}, "last_optimizer_state": {"big": 1},
                    "optimizer_history": [{"num_updates": upd}]},
                   tmp_path / f"checkpoint_{epoch}_{upd}.pt")
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")
    picked = avg.select_checkpoints(tmp_path, 3)
    assert [p.name for p in picked] == ["checkpoint_1_3000.pt", "checkpoint_2_12000.pt",
                                        "checkpoint_3_15000.pt"]  # by update count, not name
    out = avg.average_states([torch.load(p, weights_only=True) for p in picked])
    assert out["model"]["w"].dtype == torch.float16
    assert torch.equal(out["model"]["w"], torch.full((2,), 3.0, dtype=torch.float16))
    assert out["model"]["bn.num_batches_tracked"].item() == 15000  # newest, not averaged
    assert "last_optimizer_state" not in out
    assert out["optimizer_history"][-1]["num_updates"] == 15000
    with pytest.raises(ValueError, match="different parameters"):
        avg.average_states([{"model": {"a": torch.zeros(1)}}, {"model": {"b": torch.zeros(1)}}])


def test_average_checkpoints_epoch_fallback(tmp_path):
    for e in (1, 2, 10):
        (tmp_path / f"checkpoint{e}.pt").write_bytes(b"")
    assert [p.name for p in avg.select_checkpoints(tmp_path, 2)] == ["checkpoint2.pt",
                                                                     "checkpoint10.pt"]


# ------------------------------------------------------------------ shell scripts
def _sh(script, *args, python=sys.executable, **env):
    import os

    full_env = {**os.environ, "PYTHON": python, "GPUS": "1", **env}
    return subprocess.run(["bash", str(EXAMPLE / script), *args], capture_output=True, text=True,
                          env=full_env, cwd=os.getcwd())


@pytest.fixture(scope="module")
def python(python_through_servers):
    """A ``python`` whose ``-m fairseq_attnzoo.cli.archs`` (train.sh asks it for the archs) runs
    through that module's console server (conftest's ``python_through_servers``)."""
    return python_through_servers("fairseq_attnzoo.cli.archs")


@pytest.mark.parametrize("script", ["prepare.sh", "train.sh", "generate.sh"])
def test_shell_syntax(script):
    r = subprocess.run(["bash", "-n", str(EXAMPLE / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "set -euo pipefail" in (EXAMPLE / script).read_text()


def test_train_sh_unknown_arch_one_line(python):
    r = _sh("train.sh", "transformer_nope", python=python)
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1 and "unknown ARCH 'transformer_nope'" in r.stderr
    assert "transformer_synth_random_vanilla" in r.stderr and "transformer_pkm" in r.stderr
    assert r.stdout == ""


def test_train_sh_dry_run(python):
    r = _sh("train.sh", "transformer_synth_random", "--max-epoch", "3", DRY_RUN="1",
            python=python)
    assert r.returncode == 0, r.stderr
    cmd = r.stdout
    for flag in ("-m fairseq_cli.train", "--arch transformer_synth_random",
                 "--share-all-embeddings", "--lr 7e-4", "--lr-scheduler inverse_sqrt",
                 "--warmup-updates 4000", "--label-smoothing 0.1", "--dropout 0.1",
                 "--max-tokens 4096", "--update-freq 8", "--max-update 100000",
                 f"--user-dir {ROOT}/fairseq_attnzoo", f"{ROOT}/data/wmt14_en_de/bin",
                 f"--save-dir {ROOT}/checkpoints/wmt14_en_de/transformer_synth_random",
                 "--max-epoch 3"):
        assert flag in cmd, flag
    four = _sh("train.sh", "transformer_pkm", DRY_RUN="1", GPUS="4", MAX_UPDATE="250000",
               python=python).stdout
    assert "--update-freq 2" in four and "--distributed-world-size 4" in four
    assert "--optimizer pkm_adam" in four and "--max-update 250000" in four
    from fairseq_attnzoo.cli.archs import zoo_archs

    known = ["transformer"] + zoo_archs(task="translation")  # the recipe asks the registry
    assert len(known) >= 16 and "transformer_pkm" in known
    fork = _sh("train.sh", "transformer_collab_fork", DRY_RUN="1", python=python).stdout
    assert "--arch transformer_collab_fork" in fork and "--collab-key-dim 128" in fork  # (paper's)
    for arch in known:  # every known arch has a case branch
        assert _sh("train.sh", arch, DRY_RUN="1", python=python).returncode == 0, arch


def test_generate_sh_dry_run():
    r = _sh("generate.sh", "transformer_aop", DRY_RUN="1", SAVE="/tmp/ck")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "-m fairseq_attnzoo.cli.average_checkpoints --inputs /tmp/ck --last 5" in lines[0]
    assert "-m fairseq_cli.generate" in lines[1] and "--beam 4 --lenpen 0.6" in lines[1]
    assert "--remove-bpe sentencepiece" in lines[1]
    assert "--path /tmp/ck/checkpoint.avg5.pt" in lines[1]
    assert f"-m sacrebleu {ROOT}/data/wmt14_en_de/raw/test.de -i /tmp/ck/hyp.test.de" in lines[2]


def test_generate_sh_orders_hypotheses_and_scores(tmp_path):
    """fairseq-generate replaced by canned output: D- lines are put back in test-set order, their
    count is checked against the reference, and sacreBLEU's BLEU line is printed."""
    refs = ["Das ist ein Test .", "Noch ein Satz hier", "Der letzte Satz\tmit Tab"]
    data = tmp_path / "data"
    (data / "raw").mkdir(parents=True)
    write(data / "raw" / "test.de", refs)
    gen = tmp_path / "canned.out"
    gen.write_text("".join(
        f"S-{i}\tsrc\nH-{i}\t-0.1\t\u2581x\nD-{i}\t-0.1\t{refs[i]}\nP-{i}\t-0.1\n"
        for i in (2, 0, 1)) + "Generate test with beam=4: BLEU4 = 100.00\n")
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nif [[ "$1 $2" == "-m fairseq_cli.generate" ]]; then '
                    f'cat "{gen}"; exit 0; fi\nexec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    save = tmp_path / "ck"
    save.mkdir()
    r = _sh("generate.sh", "transformer", PYTHON=str(fake), DATA=str(data), SAVE=str(save),
            CKPT=str(save / "any.pt"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("BLEU") and "= 100.0" in r.stdout and r.stdout.count("\n") == 1
    assert (save / "hyp.test.de").read_text().splitlines() == refs
    assert "chrF2" in (save / "score.test.txt").read_text()

    write(data / "raw" / "test.de", refs + ["one more"])  # 3 hypotheses, 4 references
    r = _sh("generate.sh", "transformer", PYTHON=str(fake), DATA=str(data), SAVE=str(save),
            CKPT=str(save / "any.pt"))
    assert r.returncode != 0 and "3 hypotheses for 4 reference lines" in r.stderr


# ------------------------------------------------------------------ progress bars
def _as_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)


def test_progress_bars_show_totals_and_rates_on_a_terminal(raw_corpus, tmp_path, monkeypatch,
                                                           capsys):
    _as_terminal(monkeypatch)
    raw, n_read = raw_corpus
    args = ["--raw-dir", str(raw), "--out", str(tmp_path / "out"), "--vocab-size", "60",
            "--workers", "1", "--skip-binarize"]
    assert wmt.main(args) == 0
    err = capsys.readouterr().err  # bars are cleared when done: their first frame remains
    assert f"clean train:   0%|          | 0/{n_read} [00:00<?, ?pair/s]" in err
    assert "encode train.en:   0%|          | 0/300 [00:00<?, ?line/s]" in err
    assert "SentencePiece bpe 60: 00:00" in err
    # a download: bytes with the Content-Length total and a rate
    src = tmp_path / "blob.bin"
    src.write_bytes(b"x" * 300_000)
    wmt.fetch_url(src.as_uri(), tmp_path / "dl" / "blob.bin", "hint")
    err = capsys.readouterr().err
    assert "blob.bin:   0%|          | 0.00/293k [00:00<?, ?B/s]" in err
    assert (tmp_path / "dl" / "blob.bin").read_bytes() == src.read_bytes()


def test_progress_off_with_flag_or_without_terminal(raw_corpus, tmp_path, monkeypatch, capsys):
    raw, _ = raw_corpus
    args = ["--raw-dir", str(raw), "--vocab-size", "60", "--workers", "1", "--skip-binarize"]
    assert wmt.main(args + ["--out", str(tmp_path / "a")]) == 0  # stderr is not a terminal
    assert capsys.readouterr().err == ""
    _as_terminal(monkeypatch)
    assert wmt.main(args + ["--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_error_after_progress_still_ends_in_one_line(tmp_path, monkeypatch, capsys):
    _as_terminal(monkeypatch)
    for split in ("train", "valid", "test"):
        write(tmp_path / f"{split}.en", ["a b c"] * 5)
        write(tmp_path / f"{split}.de", ["a b c"] * 5)
    write(tmp_path / "valid.de", ["a b c"] * 4)  # misaligned, found after cleaning train
    assert wmt.main(["--raw-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "clean train" in err  # the bar ran
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1].replace("\x1b[A", "")
    assert last.strip().startswith("error: valid: 5 en lines but 4 de lines"), repr(err[-300:])
