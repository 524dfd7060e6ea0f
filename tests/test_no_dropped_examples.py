"""Every sentence / token is scored: fairseq 0.12 dropped the last batch when its size was not a
multiple of --required-batch-size-multiple (default 8), so fairseq-generate and validation skipped
up to 7 sentences (20 -> 16, 30 -> 24, newstest2014's 3,003 -> at most 3,000). The compat entry
``fairseq_batch_keep_tail`` keeps it as one more, smaller batch."""

import numpy as np
import pytest

from zoo_testlib import (USER_DIR, make_mono_text, make_parallel_text, preprocess, quiet, run_cli,
                         tiny_flags)

N_VALID, N_TEST = 20, 30  # neither a multiple of 8


@pytest.mark.parametrize("n,max_tokens,max_sentences", [
    (20, 4096, None), (30, 4096, None), (3003, 8192, None), (3003, None, 100), (5, 4096, None)])
def test_batch_by_size_keeps_every_index(n, max_tokens, max_sentences):
    from fairseq.data import data_utils

    rng = np.random.RandomState(0)
    lengths = rng.randint(2, 60, size=n).astype(np.int64)
    indices = np.argsort(lengths, kind="mergesort")  # fairseq sorts by length first
    batches = data_utils.batch_by_size(
        indices, lengths.__getitem__, num_tokens_vec=lengths[indices], max_tokens=max_tokens,
        max_sentences=max_sentences, required_batch_size_multiple=8)
    assert np.array_equal(np.concatenate(batches), indices)  # all of them, in order, once
    for b in batches[:-1]:
        assert len(b) % 8 == 0 or len(b) < 8
    for b in batches:
        if max_tokens:
            assert len(b) * lengths[b].max() <= max_tokens
        if max_sentences:
            assert len(b) <= max_sentences


@pytest.fixture(scope="module")
def mt20(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mt20"))
    make_parallel_text(root, n_train=64, n_valid=N_VALID, n_test=N_TEST)
    preprocess(["--source-lang", "src", "--target-lang", "tgt", "--trainpref", f"{root}/train",
                "--validpref", f"{root}/valid", "--testpref", f"{root}/test",
                "--destdir", f"{root}/bin", "--joined-dictionary", "--workers", "1"])
    return root


@pytest.fixture(scope="module")
def lm20(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lm20"))
    make_mono_text(root, n_train=64, n_valid=N_VALID, n_test=N_TEST)
    preprocess(["--only-source", "--trainpref", f"{root}/train.txt", "--validpref",
                f"{root}/valid.txt", "--testpref", f"{root}/test.txt", "--destdir",
                f"{root}/bin", "--workers", "1"])
    return root


def _train_counting_valid(monkeypatch, flags):
    """fairseq-train (in-process) a few updates; returns the sentences each validation scored."""
    from fairseq.trainer import Trainer
    from fairseq_cli import train

    runs = []
    validate, valid_step = train.validate, Trainer.valid_step

    def counting_validate(*args, **kwargs):
        runs.append(0)
        return validate(*args, **kwargs)

    def counting_step(self, sample, raise_oom=False):
        if sample:
            runs[-1] += int(sample["nsentences"])
        return valid_step(self, sample, raise_oom=raise_oom)

    monkeypatch.setattr(train, "validate", counting_validate)
    monkeypatch.setattr(Trainer, "valid_step", counting_step)
    with quiet():
        run_cli("train", flags + ["--optimizer", "adam", "--lr", "0.001", "--max-update", "2",
                                  "--max-tokens", "4096", "--num-workers", "0", "--seed", "1",
                                  "--no-epoch-checkpoints"])
    assert runs
    return runs


def test_generate_and_validation_score_every_sentence(mt20, tmp_path, monkeypatch):
    data = f"{mt20}/bin"
    flags = tiny_flags("attnzoo_transformer", data) + ["--save-dir", str(tmp_path)]
    assert set(_train_counting_valid(monkeypatch, flags)) == {N_VALID}
    for subset, n in (("valid", N_VALID), ("test", N_TEST)):
        out = run_cli("generate", [data, "--user-dir", USER_DIR, "--path",
                                   str(tmp_path / "checkpoint_last.pt"), "--gen-subset", subset,
                                   "--beam", "2", "--max-len-b", "5", "--cpu",
                                   "--max-tokens", "4096"])
        hyps = {line.split("\t")[0] for line in out if line.startswith("H-")}
        assert hyps == {f"H-{i}" for i in range(n)}, (subset, len(hyps))
        assert any(f"Translated {n} sentences" in line for line in out)


def test_lm_validation_and_eval_lm_score_every_token(lm20, tmp_path, monkeypatch):
    from fairseq.data import data_utils

    data = f"{lm20}/bin"
    flags = tiny_flags("attnzoo_lm", data) + ["--save-dir", str(tmp_path),
                                              "--sample-break-mode", "eos"]
    assert set(_train_counting_valid(monkeypatch, flags)) == {N_VALID}  # a block a sentence
    with quiet():
        test = data_utils.load_indexed_dataset(f"{data}/test", None)  # its sizes are a memory map
        tokens = int(np.asarray(test.sizes).sum())
    out = run_cli("eval_lm", [data, "--user-dir", USER_DIR, "--path",
                              str(tmp_path / "checkpoint_last.pt"), "--cpu", "--max-tokens", "4096",
                              "--sample-break-mode", "eos", "--tokens-per-sample", "24"])
    assert any(f"Evaluated {tokens:,} tokens" in line for line in out), out[-5:]
