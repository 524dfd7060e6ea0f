"""Your own text to a fairseq data directory in one step (scripts/data/prepare_text.py, issue 45):
raw parallel text or raw monolingual text -> SentencePiece -> fairseq-preprocess, the matching
--remove-bpe printed, and a mistake in one line."""

import random

from scripts.data import prepare_text

WORDS = ("la casa", "el perro", "come", "grande", "pequeño", "y", "muy", "la mesa", "verde",
         "duerme", "en", "el jardín", "con", "un gato", "azul", "corre")
ENGLISH = {"la casa": "the house", "el perro": "the dog", "come": "eats", "grande": "big",
           "pequeño": "small", "y": "and", "muy": "very", "la mesa": "the table",
           "verde": "green", "duerme": "sleeps", "en": "in", "el jardín": "the garden",
           "con": "with", "un gato": "a cat", "azul": "blue", "corre": "runs"}


def _parallel(root, n=(120, 10, 10)):
    rng = random.Random(0)
    for split, count in zip(prepare_text.SPLITS, n):
        es, en = [], []
        for _ in range(count):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 8))]
            es.append(" ".join(words).capitalize() + ".")
            en.append(" ".join(ENGLISH[w] for w in words).capitalize() + ".")
        (root / f"{split}.es").write_text("\n".join(es) + "\n", encoding="utf-8")
        (root / f"{split}.en").write_text("\n".join(en) + "\n", encoding="utf-8")


def test_parallel_text_to_data_bin_and_the_remove_bpe_to_score_it(tmp_path, capsys,
                                                                 preprocess_through_server):
    _parallel(tmp_path)
    raw, out = tmp_path, tmp_path / "out"
    code = prepare_text.main(["--src", "es", "--tgt", "en", "--train", f"{raw}/train", "--valid",
                              f"{raw}/valid", "--test", f"{raw}/test", "--out", str(out),
                              "--no-progress"])  # 8,000 pieces at most: fewer here
    printed = capsys.readouterr().out
    assert code == 0, printed
    for name in ("dict.es.txt", "dict.en.txt", "train.es-en.es.bin", "test.es-en.en.idx"):
        assert (out / "bin" / name).is_file(), name
    assert "--remove-bpe sentencepiece" in printed and f"{out}/bin" in printed
    assert f"--bpe sentencepiece --sentencepiece-model {out}/spm.model" in printed  # interactive
    from fairseq.data import Dictionary

    from fairseq_attnzoo.compat import segmentation_counts

    d = Dictionary.load(str(out / "bin" / "dict.en.txt"))
    assert segmentation_counts(d)["▁"] > 0  # the data the printed --remove-bpe matches
    assert (out / "spm" / "valid.en").read_text(encoding="utf-8").count("\n") == 10


def test_text_to_language_model_data_bin(tmp_path, capsys, preprocess_through_server):
    _parallel(tmp_path)
    code = prepare_text.main(["--train", f"{tmp_path}/train.en", "--valid",
                              f"{tmp_path}/valid.en", "--test", f"{tmp_path}/test.en", "--out",
                              str(tmp_path / "lm"), "--vocab-size", "40", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert (tmp_path / "lm" / "bin" / "dict.txt").is_file()
    assert (tmp_path / "lm" / "bin" / "train.bin").is_file()
    assert "fairseq-eval-lm" in printed and "--task language_modeling" in printed
    # the eval-lm command pasted as printed evaluates blocks of the length the model was trained
    # on (eval-lm's default is 1024: a model trained on shorter blocks refuses it)
    train, eval_lm = (next(x for x in printed.splitlines() if c in x)
                      for c in ("fairseq-train", "fairseq-eval-lm"))
    assert "--tokens-per-sample 512" in train and "--tokens-per-sample 512" in eval_lm
    assert f"--sentencepiece-model {tmp_path}/lm/spm.model" in printed  # attnzoo-sample's


def test_mistakes_are_one_line(tmp_path, capsys):
    _parallel(tmp_path)
    base = ["--valid", f"{tmp_path}/valid", "--test", f"{tmp_path}/test", "--out",
            str(tmp_path / "o"), "--no-progress"]
    (tmp_path / "short.es").write_text("uno\ndos\n")
    (tmp_path / "short.en").write_text("one\n")
    for argv, words in (
            (["--src", "es", "--train", f"{tmp_path}/train"], "both --src and --tgt"),
            (["--src", "es", "--tgt", "fr", "--train", f"{tmp_path}/train"],
             "train.fr does not exist"),
            (["--src", "es", "--tgt", "en", "--train", f"{tmp_path}/short"],
             "parallel files must be aligned")):
        assert prepare_text.main(argv + base) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and words in err and "\n" not in err, err
