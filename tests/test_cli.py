"""The console commands (fairseq_attnzoo/cli/): each runs in-process through ``main(argv)`` and
from another directory as ``python -m fairseq_attnzoo.cli.<name>``."""

import os
import subprocess
import sys

import pytest

import fairseq_attnzoo  # noqa: F401
from fairseq_attnzoo.cli import archs as archs_cli
from fairseq_attnzoo.cli import sample as sample_cli

from console_server import SERVERS, ConsoleServer
from zoo_testlib import REPO, USER_DIR, make_mono_text, preprocess, run_cli, zoo_archs

TINY_LM = ["--arch", "transformer_lm", "--decoder-layers", "1", "--decoder-embed-dim", "16",
           "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2",
           "--tokens-per-sample", "16", "--task", "language_modeling", "--optimizer", "adam",
           "--lr", "1e-3", "--max-tokens", "256", "--max-update", "2", "--cpu", "--num-workers",
           "0", "--disable-validation", "--no-epoch-checkpoints", "--user-dir", USER_DIR,
           "--seed", "1"]


def test_archs_lists_every_zoo_arch_from_another_directory():
    """``python -m fairseq_attnzoo.cli.archs --list`` in the test's own folder (not the
    repository; forked from its console server)."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    code, out, err = SERVERS.run("-m fairseq_attnzoo.cli.archs", ["--list"], env=env,
                                 cwd=os.getcwd(), timeout=120)
    assert code == 0, err[-2000:]
    assert out.split() == zoo_archs()
    mt = archs_cli.zoo_archs(task="translation", method="synth")
    assert mt and all(a.startswith("transformer_synth") for a in mt)
    assert archs_cli.zoo_archs(method="none") == ["attnzoo_lm", "attnzoo_transformer"]


def test_archs_detail_shows_slots_flags_and_paper_symbols(capsys):
    assert archs_cli.main(["transformer_pkm"]) == 0
    text = capsys.readouterr().out
    assert "decoder ffn (--decoder-ffn): ffn 0-2, pkm 3, ffn 4-5" in text
    assert "--pkm-knn 32" in text and "top-k" in text  # default and the paper's symbol
    assert archs_cli.main([]) == 0
    listing = capsys.readouterr().out
    assert all(f"{a}  [" in listing for a in zoo_archs())


def test_archs_unknown_name_is_one_line_with_a_suggestion(capsys):
    with pytest.raises(SystemExit):
        archs_cli.main(["transformer_pkn"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "did you mean transformer_pkm" in err[-1]


def _bpe_lm(root):
    """A word-level LM whose words are split into subword-nmt pieces ('w1@@ 2')."""
    make_mono_text(str(root))
    for split in ("train", "valid", "test"):
        path = root / f"{split}.txt"
        lines = path.read_text().splitlines()
        path.write_text("\n".join(" ".join(w[:2] + "@@ " + w[2:] if len(w) > 2 else w
                                           for w in line.split()) for line in lines) + "\n")
    preprocess(["--only-source", "--trainpref", f"{root}/train.txt", "--validpref",
                f"{root}/valid.txt", "--destdir", f"{root}/bin", "--workers", "1"])
    run_cli("train", [f"{root}/bin", "--save-dir", f"{root}/ck", *TINY_LM])
    return f"{root}/bin", f"{root}/ck/checkpoint_last.pt"


def test_sample_word_and_bpe_vocabularies(tmp_path, capsys):
    data, ckpt = _bpe_lm(tmp_path)
    common = [data, "--path", ckpt, "--cpu", "--len", "6", "--sampling", "--sampling-topk", "5"]
    assert sample_cli.main(common + ["--prompt", "w1@@ 2 w1@@ 4"]) == 0
    raw = capsys.readouterr().out.strip().splitlines()[-1]
    assert raw.startswith("w1@@ 2 w1@@ 4") and len(raw.split()) == 4 + 6
    assert sample_cli.main(common + ["--prompt", "w1@@ 2 w1@@ 4", "--remove-bpe"]) == 0
    text = capsys.readouterr().out.strip().splitlines()[-1]
    assert text.startswith("w12 w14") and "@@" not in text
    with pytest.raises(SystemExit) as e:
        sample_cli.main(common + ["--prompt", "zebra"])
    assert "none of the prompt's tokens is in the dictionary" in str(e.value)
    assert "--bpe" in str(e.value) and "\n" not in str(e.value)


def test_sample_from_the_data_dir_of_another_dictionary(tmp_path, lm_data):
    """Used to end in torch's "size mismatch for decoder.embed_tokens.weight" traceback."""
    _, ckpt = _bpe_lm(tmp_path)
    with pytest.raises(SystemExit) as e:
        sample_cli.main([lm_data, "--path", ckpt, "--cpu", "--len", "2"])
    message = str(e.value)
    assert "was trained with a dictionary of" in message and f"{lm_data}'s has" in message
    assert "pass the data directory the checkpoint was trained on" in message
    assert "\n" not in message


@pytest.fixture(scope="module")
def sentencepiece_lm(tmp_path_factory):
    """A tiny LM on SentencePiece-like text (every word a '▁' piece): (data, checkpoint)."""
    root = tmp_path_factory.mktemp("spm_lm")
    make_mono_text(str(root))
    for split in ("train", "valid", "test"):
        path = root / f"{split}.txt"
        path.write_text("\n".join(" ".join("▁" + w for w in line.split())
                                  for line in path.read_text().splitlines()) + "\n")
    preprocess(["--only-source", "--trainpref", f"{root}/train.txt", "--validpref",
                f"{root}/valid.txt", "--destdir", f"{root}/bin", "--workers", "1"])
    run_cli("train", [f"{root}/bin", "--save-dir", f"{root}/ck", *TINY_LM])
    return f"{root}/bin", f"{root}/ck/checkpoint_last.pt"


def test_sample_on_sentencepiece_data_without_bpe_is_refused(sentencepiece_lm, capsys):
    """Every word of the prompt used to become <unk> but one, silently."""
    data, ckpt = sentencepiece_lm
    common = [data, "--path", ckpt, "--cpu", "--len", "3"]
    with pytest.raises(SystemExit) as e:
        sample_cli.main(common + ["--prompt", "w1 w3 w5"])
    message = str(e.value)
    assert "the dictionary holds SentencePiece pieces" in message and "no --bpe" in message
    assert "--bpe sentencepiece --sentencepiece-model" in message and "\n" not in message
    assert sample_cli.main(common + ["--prompt", "▁w1 ▁w3"]) == 0  # written in pieces
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("▁w1 ▁w3")


def test_sample_console_script_prints_no_debug_lines(sentencepiece_lm):
    """attnzoo-sample printed hydra's DEBUG:hydra.core.utils lines (fairseq's imports leave the
    root logger at DEBUG)."""
    data, ckpt = sentencepiece_lm
    code, _, err = SERVERS.run("attnzoo-sample", [data, "--path", ckpt, "--cpu", "--len", "2",
                                                  "--prompt", "▁w1"],
                               env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=os.getcwd())
    assert code == 0, err[-2000:]
    assert not [x for x in err.splitlines() if "DEBUG" in x], err[-2000:]


def test_archs_shows_on_off_flags_by_name_and_the_attention_the_host_builds(capsys):
    """attnzoo_lm_llama_small showed '--no-rope True' / '--no-proj-bias False' (read as the
    opposite of what the arch does) and 'mha ... (stock)' for the ZooMultiheadAttention it
    builds."""
    assert archs_cli.main(["attnzoo_lm_llama_small"]) == 0
    text = capsys.readouterr().out
    lines = [x.strip() for x in text.splitlines()]
    assert "--rope" in lines and "--no-proj-bias" in lines
    assert not any(x.startswith(("--no-rope", "--proj-bias")) for x in lines), text
    mha = next(x for x in lines if x.startswith("mha: "))
    assert "ZooMultiheadAttention" in mha and "(stock)" not in mha
    assert archs_cli.main([]) == 0
    llama = capsys.readouterr().out.split("attnzoo_lm_llama_small  [")[1].split("\n\n")[0]
    assert "--rope --no-proj-bias" in llama and "True" not in llama.split("preset:")[1].split(
        "--no-token")[0], llama


def test_plot_help_is_plain_text(capsys):
    """attnzoo-plot --help printed the docstring's reStructuredText (``KIND``, ====)."""
    from fairseq_attnzoo.cli import plot

    assert plot.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "``" not in text and "====" not in text
    assert all(kind in text for kind in plot.KINDS) and "usage: attnzoo-plot KIND" in text


@pytest.mark.slow
def test_console_commands_of_a_plain_pip_install_work_from_another_directory(tmp_path):
    """``pip install .`` (not editable) of a copy of the package: every console command runs from
    / and imports the installed package, not this checkout."""
    import shutil

    src, site = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    shutil.copytree(os.path.join(REPO, "fairseq_attnzoo"), src / "fairseq_attnzoo",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--target", str(site), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    where = subprocess.run([sys.executable, "-c", "import fairseq_attnzoo; "
                            "print(fairseq_attnzoo.__file__)"], cwd=os.getcwd(), env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr[-1000:]
    # the console scripts: each its own process, forked from a console server of this
    # environment (PYTHONPATH: the install) after the script's imports (tests/console_server.py)
    servers = ConsoleServer(env=env)
    try:
        code, out, err = servers.run(str(site / "bin" / "attnzoo-archs"), ["--list"], env=env,
                                     cwd=os.getcwd())
        assert code == 0 and out.split() == zoo_archs(), err[-2000:]
        for command in ("attnzoo-sample", "attnzoo-average-checkpoints",
                        "attnzoo-collab-reparametrize", "attnzoo-plot"):
            code, out, err = servers.run(str(site / "bin" / command), ["--help"], env=env,
                                         cwd=os.getcwd())
            assert code == 0 and "usage" in out.lower(), (command, err[-1000:])
    finally:
        servers.close()


@pytest.mark.slow
def test_collab_finetune_command_refuses_a_missing_checkpoint(mt_data, tmp_path):
    """The converter's printed fine-tune command used --restore-file, which fairseq answers with
    an INFO line and a randomly initialised model when the file is not there: a typo in the path
    fine-tuned nothing. It now passes --finetune-from-model, which fairseq checks; the error is
    one line naming the flag."""
    import shlex

    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_attnzoo.cli.collab_reparametrize import finetune_command
    from zoo_testlib import quiet, tiny_flags

    with quiet():
        cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(
            options.get_training_parser(), tiny_flags("attnzoo_transformer", mt_data)))
    missing = str(tmp_path / "converted.pt")  # never written
    argv = shlex.split(finetune_command(cfg, missing, str(tmp_path / "ft")))
    assert "--restore-file" not in argv and argv[argv.index("--finetune-from-model") + 1] == missing
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ATTNZOO_TRACEBACK", None)
    code, _, err = SERVERS.run(argv[0], [*argv[1:], "--cpu", "--optimizer", "adam", "--lr", "1e-3",
                                         "--max-update", "1", "--max-tokens", "400"],
                               env=env, cwd=tmp_path)
    last = err.strip().splitlines()[-1]
    assert code != 0 and not (tmp_path / "ft" / "checkpoint_last.pt").exists()
    assert last.startswith("fairseq-attnzoo: --finetune-from-model") and missing in last, last
    assert "Traceback" not in err


def test_plot_spans_defaults_its_output_and_title(tmp_path, capsys):
    """``attnzoo-plot spans CKPT`` (as the README and examples/enwik8 write it) used to end in
    ``NameError: name 'os' is not defined`` unless both --out and --title were given."""
    import shutil

    pytest.importorskip("matplotlib")
    from fairseq_attnzoo.cli import plot

    ckpt = tmp_path / "run" / "checkpoint_best.pt"
    ckpt.parent.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "fixtures", "compat", "adaptive_span_lm.ckpt"), ckpt)
    assert plot.main(["spans", str(ckpt)]) == 0
    assert (tmp_path / "run" / "spans.png").stat().st_size > 0
    assert f"wrote {tmp_path / 'run' / 'spans.png'}" in capsys.readouterr().out
    out = tmp_path / "no" / "such" / "dir" / "spans.png"
    assert plot.main(["spans", str(ckpt), "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def test_plot_pkm_usage_creates_the_output_folder(tmp_path):
    """``attnzoo-plot pkm-usage --out DIR/x.png`` with a missing DIR ended in a traceback."""
    from types import SimpleNamespace

    import torch

    pytest.importorskip("matplotlib")
    from fairseq_attnzoo.cli import plot_pkm_usage

    out = tmp_path / "missing" / "x.png"
    z = torch.rand(16, dtype=torch.float64)
    plot_pkm_usage.plot({"decoder.layers.0.ffn": z}, {"decoder.layers.0.ffn":
                                                      SimpleNamespace(n_keys=4)}, str(out))
    assert out.stat().st_size > 0
