"""Every sentence / token is scored: fairseq 0.12 dropped the last batch when its size was not a
multiple of --required-batch-size-multiple (default 8), so fairseq-generate and validation skipped
up to 7 sentences (20 -> 16, 30 -> 24, newstest2014's 3,003 -> at most 3,000). The compat entry
``fairseq_batch_keep_tail`` keeps it as one more, smaller batch."""

import os

import numpy as np
import pytest

from zoo_testlib import USER_DIR, quiet, run_cli, tiny_flags

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
def mt20(tiny_data):
    return os.path.dirname(tiny_data("mt", n_train=64, n_valid=N_VALID, n_test=N_TEST))


@pytest.fixture(scope="module")
def lm20(tiny_data):
    return os.path.dirname(tiny_data("lm", n_train=64, n_valid=N_VALID, n_test=N_TEST))


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


def _too_long(data, split, bound):
    """Examples of ``split`` whose source or target (with EOS) is longer than ``bound``."""
    from fairseq.data import data_utils

    with quiet():
        src = data_utils.load_indexed_dataset(f"{data}/{split}.src-tgt.src", None)
        tgt = data_utils.load_indexed_dataset(f"{data}/{split}.src-tgt.tgt", None)
        return int(((np.asarray(src.sizes) > bound) | (np.asarray(tgt.sizes) > bound)).sum())


def test_examples_skipped_for_a_length_bound_are_counted_and_the_score_says_subset(mt20, tmp_path):
    """A --synth-max-len shorter than the data: fairseq skipped the longer examples in training
    (always) and in fairseq-generate (--skip-invalid-size-inputs-valid-test) with a warning naming
    no flag, and the BLEU line did not say it scored a subset."""
    data, bound = f"{mt20}/bin", 8
    n_train, n_test = _too_long(data, "train", bound), _too_long(data, "test", bound)
    assert 0 < n_train < 64 and 0 < n_test < N_TEST
    flags = tiny_flags("transformer_synth_dense", data) + [
        "--synth-max-len", str(bound), "--save-dir", str(tmp_path), "--optimizer", "adam",
        "--lr", "0.001", "--max-update", "1", "--max-tokens", "4096", "--num-workers", "0",
        "--no-epoch-checkpoints", "--disable-validation"]
    with quiet():
        lines = run_cli("train", flags)
    said = [x for x in lines if "'train' examples" in x]
    assert said == [f"[fairseq_attnzoo.compat] {n_train} of 64 'train' examples ({n_train / 64:.1%}) are skipped: longer "
                    f"than the ({bound}, {bound}) positions the model accepts; raise "
                    f"--synth-max-len (now {bound}) to keep them"], said
    out = run_cli("generate", [data, "--user-dir", USER_DIR, "--path",
                               str(tmp_path / "checkpoint_last.pt"), "--gen-subset", "test",
                               "--beam", "2", "--max-len-b", "5", "--cpu", "--max-tokens", "4096",
                               "--skip-invalid-size-inputs-valid-test"])
    assert any(f"{n_test} of {N_TEST} 'test' examples" in x and "--synth-max-len" in x
               for x in out), out[-10:]
    score = next(x for x in out if x.startswith("Generate test with beam=2: BLEU4 = "))
    assert score.endswith(f"[a subset: scored {N_TEST - n_test} of {N_TEST} sentences, {n_test} "
                          f"longer than the model accepts were skipped; raise --synth-max-len "
                          f"(now {bound})]"), score


def test_unskipped_long_example_names_both_fixes():
    """Without --skip-invalid-size-inputs-valid-test fairseq raises a bare Exception whose only
    advice is that flag: the hint adds the length flag to raise."""
    from fairseq_attnzoo.messages.hints import hint_for
    from fairseq_attnzoo.models import sublayers

    sublayers.forget_length_limits()
    sublayers.note_length_limit("--synth-max-len", 10)
    line = hint_for(Exception("Size of sample #1 is invalid (=(np.int32(12), np.int32(12))) since "
                              "max_positions=(10, 10), skip this example with "
                              "--skip-invalid-size-inputs-valid-test"))
    assert line.startswith("example #1 of the evaluated split is longer ((12, 12)) than the "
                           "(10, 10) positions")
    assert "raise --synth-max-len (now 10)" in line
    assert "--skip-invalid-size-inputs-valid-test" in line
    sublayers.forget_length_limits()
