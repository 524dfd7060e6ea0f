"""An adaptive-span or All-Attention checkpoint evaluated without its stream task (fairseq-eval-lm's
default --task language_modeling) scores every block without its cache of previous segments
(enwik8: 2.687 instead of 2.636 bpc) and used to say nothing. One line now says the cache is off
and gives the command that evaluates it as trained; that command runs as printed."""

import shlex

import pytest

from zoo_testlib import USER_DIR, quiet, run_cli

HINT = "the adaptive-span cache is off under --task language_modeling"


@pytest.mark.parametrize("arch", ["adaptive_span_lm", "all_attention_lm"])
def test_eval_without_the_stream_task_says_how_to_evaluate_as_trained(arch, lm_data, trained):
    ckpt = trained(arch).ckpt  # the sweep's tiny fairseq-train run of the arch
    out = run_cli("eval_lm", [lm_data, "--user-dir", USER_DIR, "--path", ckpt, "--cpu",
                              "--task", "language_modeling", "--tokens-per-sample", "24",
                              "--batch-size", "4", "--context-window", "8"])
    hints = [x for x in out if HINT in x]
    assert len(hints) == 1, out[-5:]
    command = shlex.split(hints[0].split("as trained: ", 1)[1])
    assert command[0] == "fairseq-eval-lm" and command[-2:] == ["--task", "attnzoo_stream_lm"]
    assert "language_modeling" not in command and "--context-window" not in command
    again = run_cli("eval_lm", command[1:])
    assert not any(HINT in x for x in again) and any("Evaluated" in x for x in again)


def test_a_translation_task_is_refused(mt_data):
    from fairseq import tasks

    from fairseq_attnzoo.messages.errors import ZooConfigError
    from fairseq_attnzoo.models.adaptive_span import AdaptiveSpanLanguageModel
    from zoo_testlib import parse

    args = parse("attnzoo_transformer", mt_data)
    with quiet():
        task = tasks.setup_task(args)
    with pytest.raises(ZooConfigError, match="are language models, not for --task translation: "
                       "pass --task attnzoo_stream_lm"):
        AdaptiveSpanLanguageModel.build_model(parse("adaptive_span_lm", mt_data), task)
