"""Every mistake a user can make with our flags, archs and the shipped configs ends in one line on
stderr that names the flag and the fix (the last line, ``fairseq-attnzoo: ...``), with a non-zero
exit code and no traceback unless ATTNZOO_TRACEBACK=1. Each case runs the real console script, in
a process of its own (tests/console_server.py)."""

import logging
import os

import pytest

from console_server import SERVERS, TORCHRUN
from zoo_testlib import REPO, USER_DIR, LogCapture, quiet, run_cli

TINY_MT = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
           "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
           "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
           "--decoder-attention-heads", "2"]


def cli(program, *argv, env=None, cwd=None, stdout_too=False):
    """Run a fairseq console script (in a process of its own, forked from one that has run the
    script's imports: tests/console_server.py); return (exit code, non-empty stderr lines; with
    ``stdout_too`` the lines of both, where fairseq's log goes). It runs in ``cwd``, by default the
    test's own folder (tests/conftest.py's ``own_folder``)."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.pop("ATTNZOO_TRACEBACK", None)
    full_env.update(env or {})
    code, out, err = SERVERS.run(program, argv, env=full_env, cwd=cwd or os.getcwd(),
                                 merge=stdout_too)
    return code, [line for line in (out if stdout_too else err).splitlines() if line.strip()]


def assert_one_line(code, lines, *words):
    assert code != 0, lines[-20:]
    last = lines[-1]
    assert last.startswith("fairseq-attnzoo: "), lines[-20:]
    assert all(w in last for w in words), last
    assert not any(line.startswith("Traceback") for line in lines), lines[-20:]
    return last


def train(data, *flags, **kw):
    return cli("fairseq-train", data, "--user-dir", USER_DIR, "--cpu", "--max-tokens", "500",
               "--max-update", "1", "--optimizer", "adam", "--lr", "1e-3", "--no-save",
               *TINY_MT, *flags, **kw)


def test_our_flag_error_is_one_line(mt_data):
    """A validation error of our code (a plain ValueError raised in fairseq_attnzoo)."""
    code, lines = train(mt_data, "--arch", "transformer_pkm", "--pkm-knn", "32",
                        "--pkm-n-keys", "16")
    assert_one_line(code, lines, "--pkm-knn", "--pkm-n-keys")


def test_a_kernel_that_cannot_run_here_is_one_line(mt_data, tmp_path):
    """--aop-kernel triton on a CPU outside Triton's interpreter: refused at the first forward,
    from a fresh empty folder. fairseq's train_step saves crash.pt into --save-dir when a step
    raises, and under --no-save that folder was never made: the user saw FileNotFoundError
    'checkpoints/crash.pt.tmp' instead of the refusal (it passed only where an earlier run had
    left a checkpoints/ folder). The crash checkpoint is written, as stock fairseq writes it."""
    assert not os.listdir(tmp_path)
    code, lines = train(mt_data, "--arch", "transformer_aop", "--aop-kernel", "triton",
                        env={"TRITON_INTERPRET": "0"}, cwd=tmp_path)
    last = assert_one_line(code, lines, "--aop-kernel triton cannot run", "--aop-kernel sdpa")
    assert "TRITON_INTERPRET=1 interprets them on the CPU, a test mode orders of magnitude " \
        "slower, not for training" in last  # (item 7: it read like a way to run on the CPU)
    assert os.listdir(tmp_path) == ["checkpoints"]
    assert os.listdir(tmp_path / "checkpoints") == ["crash.pt"]


@pytest.mark.parametrize("crash_save", ["writes", "fails"])
def test_a_train_step_error_under_no_save_is_the_error_raised(mt_data, monkeypatch, crash_save):
    """Any error of a training step under --no-save reaches the user as itself, in a fresh
    folder: fairseq's crash checkpoint is written into a folder made for it (stock fairseq writes
    crash.pt, --no-save or not), and when that save fails too (a full disk), one warning says so
    and the step's error goes on (before: FileNotFoundError 'checkpoints/crash.pt.tmp')."""
    from fairseq import checkpoint_utils
    from fairseq.tasks.translation import TranslationTask

    def failing_step(*args, **kwargs):  # (fairseq re-raises a RuntimeError without a crash save)
        raise ValueError("the step's own error")

    monkeypatch.setattr(TranslationTask, "train_step", failing_step)
    if crash_save == "fails":
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(checkpoint_utils, "torch_persistent_save", full_disk)
    assert not os.listdir(".")
    logs = LogCapture()
    logging.getLogger().addHandler(logs)
    try:
        with pytest.raises(ValueError, match="the step's own error"):
            run_cli("train", [mt_data, "--user-dir", USER_DIR, "--cpu", "--arch", "transformer",
                              *TINY_MT, "--optimizer", "adam", "--lr", "1e-3", "--max-tokens",
                              "500", "--max-update", "1", "--no-save"])
    finally:
        logging.getLogger().removeHandler(logs)
    warnings = [x for x in logs.records if "crash checkpoint" in x]
    if crash_save == "writes":
        assert os.listdir("checkpoints") == ["crash.pt"] and not warnings
    else:
        assert len(warnings) == 1 and "No space left" in warnings[0], warnings


# ---- weak messages (issue 64, item 9) -------------------------------------------------------------
def test_a_misspelled_flag_gets_the_closest_flag(mt_data):
    """``--pkm-nkeys`` got argparse's "unrecognized arguments" and the --help pointer alone."""
    code, lines = train(mt_data, "--arch", "transformer_pkm", "--pkm-nkeys", "16")
    assert_one_line(code, lines, "unrecognized arguments: --pkm-nkeys 16: did you mean "
                    "--pkm-n-keys?")


@pytest.mark.parametrize("kind", ["mt", "lm"])
def test_the_folder_above_the_binarised_data_points_at_its_bin(tiny_data, kind):
    """prepare_text's OUT (text, spm.model, bin/) given instead of OUT/bin: "run
    fairseq-preprocess first", though the data is binarised one folder down."""
    data = tiny_data(kind)
    out = os.path.dirname(data)
    task = ["--arch", "transformer"] if kind == "mt" else [
        "--arch", "transformer_lm", "--task", "language_modeling", "--tokens-per-sample", "16"]
    code, lines = cli("fairseq-train", out, "--user-dir", USER_DIR, "--cpu", "--max-tokens",
                      "500", "--optimizer", "adam", "--lr", "1e-3", "--no-save", *task)
    assert_one_line(code, lines, f"{out} holds no binarised data; {data} does", f"pass {data}")


def test_generate_on_language_model_data_says_so(lm_data, trained):
    """fairseq-generate on --only-source data said "no binarised language pair: run
    fairseq-preprocess first" about data that is binarised, for a language model."""
    ckpt = trained("attnzoo_lm").ckpt
    code, lines = cli("fairseq-generate", lm_data, "--user-dir", USER_DIR, "--cpu", "--path",
                      ckpt)
    assert_one_line(code, lines, f"{lm_data} is language-model data (dict.txt",
                    "fairseq-generate translates", f"fairseq-eval-lm {lm_data} --path {ckpt}")


def test_flag_of_a_sublayer_the_model_does_not_build(mt_data):
    """Used to train without a memory, exit 0 (tests/test_flag_owners.py: the rules)."""
    code, lines = train(mt_data, "--arch", "transformer_synth_random", "--pkm-knn", "8")
    assert_one_line(code, lines, "--pkm-knn is a flag of the pkm sublayer",
                    "transformer_synth_random has synth_random, mha and ffn")


def test_traceback_on_request(mt_data):
    code, lines = train(mt_data, "--arch", "transformer_pkm", "--pkm-knn", "32",
                        "--pkm-n-keys", "16", env={"ATTNZOO_TRACEBACK": "1"})
    assert code != 0 and any(line.startswith("Traceback") for line in lines)
    assert lines[-1].startswith("fairseq-attnzoo: ") and "--pkm-knn" in lines[-1]


def test_resume_with_another_master_weight_layout(mt_data, tmp_path):
    """A --bf16 checkpoint with one fp32 master per parameter (--fp16-no-flatten-grads, as every
    bf16 run kept them before fairseq_bf16_flat_masters) resumed with flat masters: torch's
    ValueError becomes one line naming both fixes."""
    flags = ["--user-dir", USER_DIR, "--cpu", "--max-tokens", "500", "--optimizer", "adam", "--lr",
             "1e-3", *TINY_MT, "--arch", "transformer", "--bf16", "--save-dir", str(tmp_path),
             "--disable-validation", "--no-epoch-checkpoints"]
    code, lines = cli("fairseq-train", mt_data, *flags, "--max-update", "1",
                      "--fp16-no-flatten-grads")
    assert code == 0, lines[-5:]
    code, lines = cli("fairseq-train", mt_data, *flags, "--max-update", "2")
    assert_one_line(code, lines, "--fp16-no-flatten-grads", "--reset-optimizer")


def test_misspelled_arch_did_you_mean(mt_data):
    code, lines = train(mt_data, "--arch", "transfomer_synth_dense")
    last = assert_one_line(code, lines, "--arch", "did you mean", "transformer_synth_dense")
    assert len(last) < 250 and len(lines) == 1, lines  # not argparse's usage and 200 choices


@pytest.mark.parametrize("program,flags", [
    ("fairseq-generate", ["--beam", "five"]),
    ("fairseq-eval-lm", ["--tokens-per-sample", "many"]),
    ("fairseq-validate", ["--max-tokens", "lots"]),
])
def test_bad_flag_value_of_other_commands_is_one_line(mt_data, program, flags):
    """argparse's own errors in the evaluation commands: one line, not the whole usage."""
    code, lines = cli(program, mt_data, "--user-dir", USER_DIR, "--path", "ckpt.pt", *flags)
    assert_one_line(code, lines, flags[0], "invalid")
    assert not any(line.startswith("usage:") for line in lines), lines[:3]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a CPU-only machine")
def test_fp16_on_cpu(mt_data):
    code, lines = train(mt_data, "--arch", "transformer_aop", "--fp16")
    assert_one_line(code, lines, "--fp16", "GPU", "drop --fp16", "--cpu")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a CPU-only machine")
def test_hydra_config_fp16_on_cpu(mt_data, tmp_path):
    """The shipped configs set common.fp16=true: on a CPU machine the hint gives the overrides
    (hydra itself would print its own report and a HYDRA_FULL_ERROR line instead)."""
    code, lines = cli(
        "fairseq-hydra-train", "--config-dir", f"{REPO}/examples/wmt14_en_de/config",
        "--config-name", "transformer_aop", f"common.user_dir={USER_DIR}", f"task.data={mt_data}",
        "task.source_lang=src", "task.target_lang=tgt", "checkpoint.save_dir=ckpt",
        "model.encoder_layers=1", "model.decoder_layers=1", "model.encoder_embed_dim=16",
        "model.decoder_embed_dim=16", "model.encoder_ffn_embed_dim=32",
        "model.decoder_ffn_embed_dim=32", "dataset.num_workers=0", cwd=tmp_path)
    assert_one_line(code, lines, "common.fp16=false", "common.cpu=true")
    assert not (tmp_path / "outputs").exists()  # hydra's run dir is under checkpoint.save_dir
    assert (tmp_path / "ckpt" / "hydra").is_dir()


@pytest.fixture(scope="module")
def synth_lm(lm_data, tmp_path_factory):
    """A Synthesizer LM whose tables hold 24 positions, trained 1 update."""
    from zoo_testlib import tiny_flags

    save = str(tmp_path_factory.mktemp("synth_lm"))
    flags = tiny_flags("transformer_lm_synth_dense", lm_data) + [
        "--synth-max-len", "24", "--tokens-per-sample", "24", "--save-dir", save,
        "--optimizer", "adam", "--lr", "1e-3", "--max-update", "1", "--max-tokens", "400",
        "--num-workers", "0", "--no-epoch-checkpoints", "--disable-validation"]
    with quiet():
        run_cli("train", flags)
    return os.path.join(save, "checkpoint_last.pt")


@pytest.mark.parametrize("flags,words", [
    ([], ["evaluate nothing", "--tokens-per-sample 1024", "24 positions",
          "--tokens-per-sample 24"]),
    # fairseq skips the blocks of 32 and evaluates the last, shorter one, which its context makes
    # longer than the tables: the model says so (compat warned before, in the log)
    (["--tokens-per-sample", "32", "--context-window", "16"],
     ["sequence length 32", "synthesizer max length 24", "--synth-max-len"]),
])
def test_eval_lm_refuses_a_block_the_model_cannot_serve(lm_data, synth_lm, flags, words):
    """Used to report "Evaluated 0 tokens ... Perplexity: 1.00" and exit 0."""
    code, lines = cli("fairseq-eval-lm", lm_data, "--user-dir", USER_DIR, "--path", synth_lm,
                      "--cpu", *flags)
    assert_one_line(code, lines, *words)


def test_eval_lm_within_the_bound_scores(lm_data, synth_lm):
    out = run_cli("eval_lm", [lm_data, "--user-dir", USER_DIR, "--path", synth_lm, "--cpu",
                              "--tokens-per-sample", "24"])
    assert not any("Evaluated 0 tokens" in line for line in out)
    assert any("Evaluated" in line for line in out)


def lm_train(data, *flags, **kw):
    return cli("fairseq-train", data, "--user-dir", USER_DIR, "--cpu", "--max-tokens", "200",
               "--max-update", "1", "--optimizer", "adam", "--lr", "1e-3", "--no-save",
               "--decoder-layers", "1", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim",
               "32", "--decoder-attention-heads", "2", *flags, **kw)


@pytest.mark.slow
def test_resume_with_another_arch(mt_data, tmp_path):
    """Used to print two tracebacks, then fairseq's "please ensure that the architectures
    match"."""
    flags = ["--save-dir", str(tmp_path), "--disable-validation", "--no-epoch-checkpoints"]
    code, lines = cli("fairseq-train", mt_data, "--user-dir", USER_DIR, "--cpu", "--max-tokens",
                      "500", "--max-update", "1", "--optimizer", "adam", "--lr", "1e-3", *TINY_MT,
                      "--arch", "transformer_aop", *flags)
    assert code == 0, lines[-5:]
    code, lines = train(mt_data, "--arch", "transformer_synth_dense", *flags[:2])
    assert_one_line(code, lines, "trained with --arch transformer_aop",
                    "this run has --arch transformer_synth_dense", "resume with --arch "
                    "transformer_aop", "another --save-dir")


def test_lm_task_on_translation_data(mt_data):
    """Used to say "dict.txt is missing ... run fairseq-preprocess" of data that is binarised."""
    code, lines = lm_train(mt_data, "--arch", "transformer_lm_aop", "--task", "language_modeling",
                           "--tokens-per-sample", "16")
    assert_one_line(code, lines, "is translation data (dict.src.txt, dict.tgt.txt)",
                    "--only-source", "--task translation")
    # (the run loaded its config first: no hydra deprecation warning on stderr)
    assert not any("hydra" in line or "Warning" in line for line in lines), lines


@pytest.mark.parametrize("flags,words", [
    # the task's own flag: argparse's "unrecognized arguments: --tokens-per-sample 24" before
    (["--tokens-per-sample", "24"],
     ["unrecognized arguments: --tokens-per-sample 24", "--arch adaptive_span_lm trains with "
      "--task attnzoo_stream_lm", "add --task attnzoo_stream_lm"]),
    # no task flag: the translation task looked for a language pair in LM data
    ([], ["--arch adaptive_span_lm is a language model", "add --task attnzoo_stream_lm"]),
])
def test_lm_arch_without_its_task(lm_data, flags, words):
    code, lines = lm_train(lm_data, "--arch", "adaptive_span_lm", *flags)
    assert_one_line(code, lines, *words)


def test_empty_split(tmp_path):
    """An empty valid file binarises to an empty .bin: numpy's "cannot mmap an empty file"
    traceback (and a second one from fairseq's dataset destructor) before."""
    from zoo_testlib import make_mono_text, preprocess

    make_mono_text(str(tmp_path))
    (tmp_path / "valid.txt").write_text("")
    preprocess(["--only-source", "--trainpref", f"{tmp_path}/train.txt", "--validpref",
                f"{tmp_path}/valid.txt", "--destdir", f"{tmp_path}/bin", "--workers", "1"])
    code, lines = lm_train(f"{tmp_path}/bin", "--arch", "transformer_lm_aop", "--task",
                           "language_modeling", "--tokens-per-sample", "16")
    assert_one_line(code, lines, "valid.bin is empty", "'valid' split has no examples",
                    "--validpref", "--disable-validation")
    assert not any("Exception ignored" in line for line in lines)


def test_hints_for_known_fairseq_errors(monkeypatch, tmp_path):
    from fairseq_attnzoo.messages.hints import hint_for
    from fairseq_attnzoo.messages.one_line import one_line

    xla = AttributeError("'NoneType' object has no attribute 'xla_device'")
    cpu = hint_for(xla, cuda=False)
    assert "--bf16" in cpu and "--cpu" in cpu and "use --fp16" not in cpu
    gpu = hint_for(xla, cuda=True)
    assert "--bf16" in gpu and "--amp" in gpu
    # our validation errors: a ValueError raised by our code; not one raised elsewhere
    from fairseq_attnzoo.messages.errors import ZooConfigError
    from fairseq_attnzoo.models.synthesizer import parse_mix

    with pytest.raises(ValueError) as err:
        parse_mix("nosuch")
    assert one_line(err.value).startswith("--synth-mix 'nosuch'")
    assert one_line(ValueError("from somewhere else")) is None
    assert one_line(ZooConfigError("--x 1: pass --x 2")) == "--x 1: pass --x 2"
    # a checkpoint of another dictionary (fairseq-generate/-eval-lm/-validate on the wrong data)
    mismatch = RuntimeError(
        "Error(s) in loading state_dict for TransformerLanguageModel:\n\tsize mismatch for "
        "decoder.embed_tokens.weight: copying a param with shape torch.Size([1204, 16]) from "
        "checkpoint, the shape in current model is torch.Size([96, 16]).")
    line = hint_for(mismatch, data="data-bin/other")
    assert "dictionary of 1,204 symbols" in line and "data-bin/other's has 96" in line
    assert hint_for(AssertionError("Must specify batch size either with --max-tokens or "
                                   "--batch-size")).startswith("no batch size: pass --max-tokens")



def test_each_hint_is_a_rule_of_its_own_asked_in_order(monkeypatch):
    """``hint_for`` asks the rules of ``RULES`` in order, the first line wins; each rule answers for
    its own error alone (asked here by name, outside ``hint_for``), and None for any other."""
    from fairseq_attnzoo.messages import hints
    from fairseq_attnzoo.messages.hints import (RULES, HintContext, hint_for, hint_no_batch_size,
                                                hint_no_cuda)

    assert len(set(RULES)) == len(RULES) >= 13
    assert all(rule.__name__.startswith("hint_") for rule in RULES)
    exc = AssertionError("Must specify batch size either with --max-tokens or --batch-size")
    hydra = HintContext(data=None, hydra=True)
    assert hint_no_batch_size(exc, str(exc), hydra) == ("no batch size: set dataset.max_tokens=N "
                                                        "or dataset.batch_size=N")
    assert hint_no_cuda(exc, str(exc), hydra) is None
    other = ValueError("something else")
    assert [rule(other, str(other), hydra) for rule in RULES] == [None] * len(RULES)
    asked = []
    monkeypatch.setattr(hints, "RULES", [lambda e, t, c: asked.append(1),
                                         lambda e, t, c: f"{t} ({c.data})",
                                         lambda e, t, c: asked.append(3)])
    assert hint_for(other, data="bin") == "something else (bin)" and asked == [1]

PKM_TINY = ["--arch", "transformer_pkm", "--pkm-n-keys", "8", "--pkm-k-dim", "8", "--pkm-heads",
            "2", "--pkm-knn", "4", "--disable-validation", "--no-epoch-checkpoints"]


@pytest.fixture(scope="module")
def pkm_checkpoint(mt_data, tmp_path_factory):
    """A transformer_pkm checkpoint trained one update with --optimizer pkm_adam."""
    save = str(tmp_path_factory.mktemp("pkm_ckpt"))
    code, lines = cli("fairseq-train", mt_data, "--user-dir", USER_DIR, "--cpu", "--max-tokens",
                      "500", "--max-update", "1", "--optimizer", "pkm_adam", "--lr", "1e-3",
                      *TINY_MT, *PKM_TINY, "--save-dir", save)
    assert code == 0, lines[-5:]
    return save


def _resume(mt_data, save, *flags):
    return cli("fairseq-train", mt_data, "--user-dir", USER_DIR, "--cpu", "--max-tokens", "500",
               "--max-update", "2", "--lr", "1e-3", *TINY_MT, *PKM_TINY, "--save-dir", save,
               *flags)


def test_resume_with_another_optimizer(mt_data, pkm_checkpoint):
    """Used to end in fairseq's 20-line AssertionError traceback."""
    code, lines = _resume(mt_data, pkm_checkpoint, "--optimizer", "adam")
    assert_one_line(code, lines, "trained with --optimizer pkm_adam", "this run has --optimizer "
                    "adam", "--reset-optimizer")


def test_resume_with_another_embedding_width_names_the_flags(mt_data, pkm_checkpoint):
    """Used to say "trained with a dictionary of N symbols but ...'s has N" (the same N)."""
    code, lines = _resume(mt_data, pkm_checkpoint, "--optimizer", "pkm_adam",
                          "--decoder-embed-dim", "32")
    last = assert_one_line(code, lines, "--decoder-embed-dim 16 (checkpoint) vs 32 (this run)",
                           "another --save-dir")
    assert "dictionary" not in last and "--encoder-embed-dim" not in last


def test_remove_bpe_of_the_other_segmentation_is_refused():
    from fairseq.data import Dictionary

    from fairseq_attnzoo.compat import remove_bpe_mismatch

    pieces, markers = Dictionary(), Dictionary()
    for w in ("▁the", "▁cat", "s", "▁sat"):
        pieces.add_symbol(w)
    for w in ("the", "ca@@", "t", "sa@@"):
        markers.add_symbol(w)
    line = remove_bpe_mismatch(pieces, "@@ ")
    assert line.startswith("--remove-bpe removes subword-nmt's '@@' markers") and line.endswith(
        "pass --remove-bpe sentencepiece"), line
    assert "3 pieces marked '▁'" in line
    assert remove_bpe_mismatch(markers, "sentencepiece").endswith("pass --remove-bpe subword_nmt")
    for d, value in ((pieces, "sentencepiece"), (markers, "@@ "), (markers, "subword_nmt"),
                     (pieces, None), (markers, "letter"), (Dictionary(), "@@ ")):
        assert remove_bpe_mismatch(d, value) is None, value


def test_generate_refuses_remove_bpe_on_sentencepiece_data(tmp_path):
    """Used to score the pieces with exit 0 (a BLEU higher than the true one)."""
    from zoo_testlib import make_parallel_text, preprocess

    make_parallel_text(str(tmp_path), n_train=40, n_valid=8, n_test=8)
    for name in os.listdir(tmp_path):  # SentencePiece-like data: every word a '▁' piece
        path = tmp_path / name
        path.write_text("\n".join(" ".join("▁" + w for w in line.split())
                                  for line in path.read_text().splitlines()) + "\n")
    preprocess(["--source-lang", "src", "--target-lang", "tgt", "--trainpref",
                f"{tmp_path}/train", "--validpref", f"{tmp_path}/valid", "--testpref",
                f"{tmp_path}/test", "--destdir", f"{tmp_path}/bin", "--joined-dictionary",
                "--workers", "1"])
    data = f"{tmp_path}/bin"
    code, lines = cli("fairseq-train", data, "--user-dir", USER_DIR, "--cpu", "--max-tokens",
                      "500", "--max-update", "1", "--optimizer", "adam", "--lr", "1e-3",
                      *TINY_MT, "--arch", "transformer", "--save-dir", str(tmp_path / "ckpt"),
                      "--disable-validation", "--no-epoch-checkpoints")
    assert code == 0, lines[-5:]
    gen = [data, "--user-dir", USER_DIR, "--cpu", "--path", str(tmp_path / "ckpt" /
           "checkpoint_last.pt"), "--gen-subset", "test", "--beam", "1", "--max-len-b", "5",
           "--batch-size", "8", "--scoring", "sacrebleu"]
    code, lines = cli("fairseq-generate", *gen, "--remove-bpe")
    assert_one_line(code, lines, "--remove-bpe removes subword-nmt's '@@' markers",
                    "pass --remove-bpe sentencepiece")
    code, lines = cli("fairseq-generate", *gen, "--remove-bpe", "sentencepiece")
    assert code == 0, lines[-5:]  # (the score is on stdout)


def test_examples_skipped_for_max_tokens_name_it_and_nothing_left_is_one_line(tmp_path):
    """An LM's blocks (--tokens-per-sample 1024) longer than --max-tokens, which fairseq folds
    into the size filter: the warning blamed the model's positions, and with every block skipped
    fairseq's IndexError traceback followed."""
    from zoo_testlib import preprocess

    lines = [" ".join(f"w{(7 * i + j) % 30}" for j in range(40)) for i in range(60)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")  # blocks 1024, 1024, 412
    preprocess(["--only-source", "--trainpref", f"{tmp_path}/train.txt", "--destdir",
                f"{tmp_path}/bin", "--workers", "1"])

    def lm(max_tokens, **kw):
        return cli("fairseq-train", f"{tmp_path}/bin", "--user-dir", USER_DIR, "--cpu", "--task",
                   "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "1",
                   "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
                   "--decoder-attention-heads", "2", "--max-tokens", str(max_tokens),
                   "--optimizer", "adam", "--lr", "1e-3", "--max-update", "1", "--no-save",
                   "--disable-validation", **kw)

    code, lines = lm(300)
    last = assert_one_line(code, lines, "all 3 'train' examples are skipped",
                           "longer than --max-tokens 300", "raise --max-tokens")
    assert "--max-target-positions" not in last
    code, lines = lm(500, stdout_too=True)
    assert code == 0, lines[-5:]
    said = [x for x in lines if "'train' examples" in x]
    assert len(said) == 1 and "2 of 3 'train' examples" in said[0] and \
        "longer than --max-tokens 500" in said[0], said


# ---- issue 56: the newcomer's path, fourth round -------------------------------------------------

def _eval(program, data, ckpt, *flags):
    return cli(program, data, "--user-dir", USER_DIR, "--cpu", "--path", ckpt, *flags)


def test_eval_lm_of_a_translation_checkpoint(trained, lm_data):
    """Used to end in AttributeError: 'TransformerModel' object has no attribute
    'supported_targets'."""
    run = trained("attnzoo_transformer")
    code, lines = _eval("fairseq-eval-lm", lm_data, run.ckpt)
    assert_one_line(code, lines, f"{run.ckpt} is a translation model (--arch "
                    "attnzoo_transformer)", "fairseq-eval-lm scores language models",
                    "fairseq-generate")


def test_misspelled_remove_bpe_value(trained):
    """Used to end in a 32-line traceback and 'Unknown post_process option'."""
    run = trained("attnzoo_transformer")
    code, lines = _eval("fairseq-generate", run.data, run.ckpt, "--gen-subset", "test", "--beam",
                        "1", "--remove-bpe", "sentencepeice")
    assert_one_line(code, lines, "--remove-bpe sentencepeice is not a value fairseq knows",
                    "did you mean --remove-bpe sentencepiece?")


def test_generate_with_a_language_model_checkpoint(trained, mt_data):
    """Used to blame the dictionary sizes (the LM's data has other symbols)."""
    run = trained("attnzoo_lm")
    code, lines = _eval("fairseq-generate", mt_data, run.ckpt, "--gen-subset", "test", "--beam",
                        "1")
    last = assert_one_line(code, lines, f"{run.ckpt} is a language model (trained with --task "
                           "language_modeling)", "this run's task is translation",
                           "fairseq-eval-lm")
    assert "dictionary of" not in last


def _cut_in_half(path):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])


@pytest.mark.parametrize("program", ["fairseq-generate", "fairseq-train"])
def test_truncated_checkpoint_names_the_file_and_those_that_load(trained, tmp_path, program):
    """A save cut short (a crash, a full disk): 'PytorchStreamReader failed reading zip archive'
    after a traceback, in generate and in a resume."""
    from zoo_testlib import sweep_train_flags

    run = trained("attnzoo_transformer")
    folder = run.copy_to(tmp_path / "ckpt")
    last = os.path.join(folder, "checkpoint_last.pt")
    _cut_in_half(last)
    if program == "fairseq-generate":
        code, lines = _eval(program, run.data, last, "--gen-subset", "test", "--beam", "1")
        fix = f"pass --path {folder}/checkpoint_best.pt"
    else:
        code, lines = cli(program, *sweep_train_flags("attnzoo_transformer", run.data, folder, 4))
        fix = f"resume with --restore-file {folder}/checkpoint_best.pt"
    assert_one_line(code, lines, f"{last} is not a whole checkpoint", "cut short",
                    f"these in {folder} load: checkpoint_best.pt (update 3)", fix)


def test_no_save_creates_no_checkpoint_folder(mt_data, tmp_path):
    code, lines = train(mt_data, "--arch", "transformer", cwd=tmp_path)
    assert code == 0, lines[-5:]
    assert not (tmp_path / "checkpoints").exists()


def test_absent_biases_are_not_logged_as_shared_parameters(mt_data, tmp_path):
    """--no-proj-bias logged a 'detected shared parameter' line per absent bias; the tied
    embedding is still found."""
    code, lines = train(mt_data, "--arch", "attnzoo_transformer", "--no-proj-bias",
                        "--share-decoder-input-output-embed", stdout_too=True, cwd=tmp_path)
    assert code == 0, lines[-5:]
    shared = [x for x in lines if "detected shared parameter" in x]
    assert len(shared) == 1 and "decoder.embed_tokens.weight <- " \
        "decoder.output_projection.weight" in shared[0], shared


LLAMA = "attnzoo_lm_llama_small"


@pytest.mark.parametrize("flags,words", [
    # same parameter shapes: fairseq loaded it without a word
    (["--no-rope"], ["--rope True (checkpoint) vs False (this run)",
                     "--rope-theta 500000.0 (checkpoint) vs 10000.0 (this run)"]),
    (["--rope-theta", "20000"], ["--rope-theta 500000.0 (checkpoint) vs 20000.0 (this run)"]),
    # other shapes: refused before fairseq's "please ensure that the architectures match"
    (["--norm", "layernorm"], ["--norm rmsnorm (checkpoint) vs layernorm (this run)"]),
    (["--proj-bias"], ["--proj-bias False (checkpoint) vs True (this run)"]),
    (["--decoder-ffn", "ffn"], ["--decoder-ffn swiglu (checkpoint) vs ffn (this run)"]),
])
def test_resume_with_other_host_options_names_them(trained, tmp_path, flags, words):
    from zoo_testlib import sweep_train_flags

    run = trained(LLAMA)
    folder = run.copy_to(tmp_path / "ckpt")
    code, lines = cli("fairseq-train", *sweep_train_flags(LLAMA, run.data, folder, 4), *flags)
    assert_one_line(code, lines, *words, "resume with the checkpoint's values")


def test_resume_with_the_same_host_options_resumes(trained, tmp_path):
    from zoo_testlib import sweep_train_flags

    run = trained(LLAMA)
    folder = run.copy_to(tmp_path / "ckpt")
    code, lines = cli("fairseq-train", *sweep_train_flags(LLAMA, run.data, folder, 4),
                      stdout_too=True)
    assert code == 0, lines[-5:]
    assert any("num_updates" in x and '"4"' in x for x in lines), lines[-5:]


def _interrupted(shims, flags, cwd, when):
    """Run fairseq-train (its shim in ``shims``: tests/console_server.py, SIGINT forwarded) with
    ``flags`` in ``cwd``, send it SIGINT at the first output line for which ``when(line)`` holds:
    (exit code, its lines)."""
    import signal
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("ATTNZOO_TRACEBACK", None)
    # SIGINT at its default in the child whatever this process inherited: a shell starts
    # background jobs (`make test &`, a CI step) with SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler -- the signal would be lost and the run go on
    proc = subprocess.Popen([os.path.join(shims, "fairseq-train"), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(cwd),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if when(line):
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode or 1, lines + [x for x in rest.splitlines() if x.strip()]


def test_ctrl_c_during_training_says_where_it_resumes(mt_data, console_shims, tmp_path):
    """SIGINT to a real fairseq-train after it saved a checkpoint: one line naming the checkpoint
    and its update, not a KeyboardInterrupt traceback."""
    from zoo_testlib import sweep_train_flags

    save = str(tmp_path / "ckpt")
    flags = sweep_train_flags("attnzoo_transformer", mt_data, save, 100000) + [
        "--save-interval-updates", "10", "--save-interval", "1000", "--log-format", "simple",
        "--disable-validation"]  # (one save every 10 updates, none at an epoch's end)
    code, lines = _interrupted(console_shims("fairseq-train"), flags, tmp_path,
                               lambda line: "Saved checkpoint" in line)
    import torch

    state = torch.load(f"{save}/checkpoint_last.pt", map_location="cpu", weights_only=False)
    update = state["optimizer_history"][-1]["num_updates"]
    assert update and update % 10 == 0
    assert_one_line(code, lines, f"interrupted: {save}/checkpoint_last.pt holds "
                    f"update {update}", "the same command resumes from it")
    assert not any("KeyboardInterrupt" in x for x in lines), lines[-10:]


def test_ctrl_c_under_no_save_says_it_went_on_from_the_loaded_update(trained, console_shims,
                                                                     tmp_path):
    """--no-save in a folder holding a checkpoint_last.pt: fairseq loaded its update (3) and
    went on, saving nothing. The line said "nothing was saved; the same command starts again at
    update 0"; it says where the run started and where the same command starts again."""
    from zoo_testlib import sweep_train_flags

    run = trained("attnzoo_transformer")
    save = run.copy_to(tmp_path / "ckpt")
    flags = sweep_train_flags("attnzoo_transformer", run.data, save, 100000) + ["--no-save"]
    code, lines = _interrupted(console_shims("fairseq-train"), flags, tmp_path,
                               lambda line: '"num_updates": "5"' in line)
    assert any('"num_updates": "4"' in x for x in lines), lines[-10:]  # it went on from 3
    assert_one_line(code, lines, "nothing new was saved (--no-save)",
                    f"this run had loaded update 3 from {save}/checkpoint_last.pt and went on "
                    "from it, so the same command starts again from update 3")


def test_ctrl_c_inside_a_callback_still_stops_the_command():
    """A Ctrl-C that Python delivers while a weakref callback (or a ``__del__``, the garbage
    collector) runs cannot propagate from there: Python printed "Exception ignored in ..." with a
    KeyboardInterrupt traceback and the command went on training (seen once in the suite, in
    test_ctrl_c_during_training_says_where_it_resumes). In a console script it stops the command
    (row python_interrupt_in_callback)."""
    code = ("import sys, weakref\n"
            "sys.argv[0] = 'fairseq-train'\n"
            "import fairseq_attnzoo\n"
            "fairseq_attnzoo.enable()\n"
            "class Held: pass\n"
            "def arrives_here(ref): raise KeyboardInterrupt  # as Ctrl-C in this callback\n"
            "held = Held(); ref = weakref.ref(held, arrives_here)\n"
            "try:\n"
            "    del held\n"
            "    for _ in range(10 ** 7): pass\n"
            "    print('went on')\n"
            "except KeyboardInterrupt:\n"
            "    print('stopped')\n")
    # (as python -c, forked from a process that imported fairseq: tests/console_server.py)
    returncode, out, err = SERVERS.run("-c", [code], env=dict(os.environ, PYTHONPATH=REPO),
                                       cwd=REPO, timeout=120, preload=("fairseq",))
    assert returncode == 0, err[-3000:]
    assert out.split() == ["stopped"], (out, err[-3000:])
    assert "Exception ignored" not in err, err[-3000:]


@pytest.fixture(scope="module")
def sentencepiece_run(tmp_path_factory):
    """SentencePiece-like translation data (every word a '▁' piece) and a transformer trained one
    update on it: (data, checkpoint, folder)."""
    from zoo_testlib import make_parallel_text, preprocess

    root = tmp_path_factory.mktemp("spm_data")
    make_parallel_text(str(root), n_train=40, n_valid=8, n_test=8)
    for name in os.listdir(root):
        path = root / name
        path.write_text("\n".join(" ".join("▁" + w for w in line.split())
                                  for line in path.read_text().splitlines()) + "\n")
    preprocess(["--source-lang", "src", "--target-lang", "tgt", "--trainpref", f"{root}/train",
                "--validpref", f"{root}/valid", "--testpref", f"{root}/test", "--destdir",
                f"{root}/bin", "--joined-dictionary", "--workers", "1"])
    data = f"{root}/bin"
    code, lines = cli("fairseq-train", data, "--user-dir", USER_DIR, "--cpu", "--max-tokens",
                      "500", "--max-update", "1", "--optimizer", "adam", "--lr", "1e-3",
                      *TINY_MT, "--arch", "transformer", "--save-dir", str(root / "ckpt"),
                      "--disable-validation", "--no-epoch-checkpoints")
    assert code == 0, lines[-5:]
    return data, str(root / "ckpt" / "checkpoint_last.pt"), root


def test_interactive_on_sentencepiece_data_without_bpe(sentencepiece_run):
    """Used to translate '<unk> <unk> ...' with exit 0."""
    data, ckpt, root = sentencepiece_run
    (root / "words.txt").write_text("s1 s2 s3\n")
    (root / "pieces.txt").write_text("▁s1 ▁s2 ▁s3\n")
    run = ("fairseq-interactive", data, "--user-dir", USER_DIR, "--cpu", "--path", ckpt,
           "--beam", "1", "--source-lang", "src", "--target-lang", "tgt", "--input")
    code, lines = cli(*run, str(root / "words.txt"))
    assert_one_line(code, lines, "the dictionary holds SentencePiece pieces",
                    "no --bpe is given", "--bpe sentencepiece --sentencepiece-model")
    code, lines = cli(*run, str(root / "pieces.txt"), stdout_too=True)  # written in pieces
    assert code == 0 and any(x.startswith("H-0") for x in lines), lines[-5:]


def test_sacrebleu_scorer_does_not_call_fairseq_s_own_tokenization_a_mistake(caplog):
    """fairseq's --scoring sacrebleu tokenizes (13a) and hands sacrebleu tokenize='none': sacrebleu
    warned 'It looks like you forgot to detokenize your test data' on every run of 100+ sentences
    ending in '.'. The score is the same."""
    import logging

    from fairseq.scoring import build_scorer

    scorer = build_scorer("sacrebleu", None)
    for i in range(120):
        scorer.add_string(f"The cat number {i} sat.", f"The cat number {i} sat.")
    with caplog.at_level(logging.WARNING, logger="sacrebleu"):
        assert scorer.score() == pytest.approx(100.0)
        assert "BLEU = 100.00" in scorer.result_string()
    assert not [r for r in caplog.records if "detokenize" in r.getMessage()], caplog.text


RANK_DRIVER = '''
import os, runpy, sys
from fairseq_cli import train  # noqa: F401  (fairseq-train's own imports: the server's, once)


def main():
    script = os.path.join(os.path.dirname(sys.executable), "fairseq-train")
    sys.argv = [script] + sys.argv[1:] + ["--distributed-rank", os.environ["RANK"],
                                          "--device-id", os.environ["LOCAL_RANK"]]
    if os.environ["RANK"] == "1":  # this rank's training step fails at update 2; rank 0 waits
        import fairseq_attnzoo
        from fairseq.tasks.translation import TranslationTask
        from fairseq_attnzoo.messages.errors import ZooConfigError

        fairseq_attnzoo.enable()  # (--user-dir finds the package imported: it applies nothing)
        step = TranslationTask.train_step

        def failing(self, sample, model, criterion, optimizer, update_num, *args, **kwargs):
            if update_num == 1:
                raise ZooConfigError("rank 1's own error")
            return step(self, sample, model, criterion, optimizer, update_num, *args, **kwargs)

        TranslationTask.train_step = failing
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
'''


@pytest.mark.slow
def test_under_torchrun_a_rank_that_lost_its_peer_says_one_line(mt_data, tmp_path):
    """One rank's error on 2 gloo processes: the other rank, waiting in a collective, printed
    gloo's 'Connection closed by peer' traceback after the one line; it now prints one line
    saying it lost its peer, and the failing rank's own line stays."""
    driver = tmp_path / "rank_driver.py"
    driver.write_text(RANK_DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)  # (the driver imports us)
    env.pop("ATTNZOO_TRACEBACK", None)
    shim = SERVERS.shim(str(tmp_path / "bin"), str(driver))
    code, out, err = SERVERS.run(TORCHRUN, [
        "--standalone", "--nproc_per_node", "2",
        "--monitor-interval", "2",  # (rank 0 meets the closed peer before torchrun stops it)
        "--no-python", shim, mt_data, "--user-dir", USER_DIR, "--cpu", "--arch", "transformer",
        *TINY_MT, "--max-tokens", "500", "--optimizer", "adam", "--lr", "1e-3", "--max-update",
        "4", "--no-save", "--num-workers", "0", "--distributed-backend", "gloo",
        "--distributed-init-method", "env://", "--distributed-no-spawn",
        "--distributed-world-size", "2", "--ddp-backend", "legacy_ddp"],
        env=env, cwd=tmp_path, timeout=300)
    ranks = [x for x in (out + err).splitlines() if x.startswith("[rank")]
    assert code != 0
    assert not any("Traceback" in x for x in ranks), ranks[-30:]
    assert [x for x in ranks if "fairseq-attnzoo: " in x] == [
        "[rank1]: fairseq-attnzoo: rank 1's own error",
        "[rank0]: fairseq-attnzoo: rank 0 stopped: another process of this job ended (Connection "
        "closed by peer in a collective); that process's own error, printed with its rank, is the "
        "one to read"], ranks[-30:]
