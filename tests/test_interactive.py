"""fairseq-interactive keeps going through what a user types (compat entry
``fairseq_interactive_lines``): a blank line gets an empty hypothesis (fairseq translated it into
whatever the model says after nothing: "day", "Image"), a line longer than the model accepts one
warning naming the limit, and the lines after it are translated (fairseq ended the session with a
message written for scoring a split)."""

import re

import pytest

from zoo_testlib import USER_DIR, run_cli

LONG = " ".join(f"s{i % 24}" for i in range(1100))  # more than the model's 1,024 positions


def _interactive(run, tmp_path, lines, *flags):
    text = tmp_path / "input.txt"
    text.write_text("\n".join(lines) + "\n")
    return run_cli("interactive", [run.data, "--user-dir", USER_DIR, "--cpu", "--path", run.ckpt,
                                   "--beam", "2", "--source-lang", "src", "--target-lang", "tgt",
                                   "--input", str(text), *flags])


def _by_kind(out, kind):
    """``{line number: text}`` of fairseq-interactive's ``kind`` lines (``S``, ``H``)."""
    found = {}
    for line in out:
        m = re.match(rf"{kind}-(\d+)\t(.*)$", line)
        if m:
            found[int(m.group(1))] = m.group(2)
    return found


@pytest.mark.parametrize("buffer_size", [1, 3])
def test_blank_and_too_long_lines_do_not_end_the_session(trained, tmp_path, buffer_size):
    run = trained("attnzoo_transformer")
    out = _interactive(run, tmp_path, ["s1 s2 s3", "", "   ", LONG, "s4 s5 s6"],
                       "--buffer-size", str(buffer_size))
    hyps = _by_kind(out, "H")
    assert sorted(hyps) == [0, 1, 2, 4], out[-20:]  # the long line (3) skipped, 4 translated
    assert hyps[1] == hyps[2] == "0.0\t"  # blank: an empty hypothesis, nothing translated
    assert hyps[0].split("\t")[1] and hyps[4].split("\t")[1]
    assert [int(x.split("\t")[0][2:]) for x in out if x.startswith("S-")] == [0, 1, 2, 4]
    warned = [x for x in out if "is longer than" in x]
    assert len(warned) == 1 and "line 4 (1,101 tokens" in warned[0], warned
    assert "the 1,024 positions the model accepts: skipped" in warned[0]
    assert not any("covers a subset" in x or "are skipped" in x for x in out)


def test_a_blank_line_gets_an_empty_hypothesis(trained, tmp_path):
    run = trained("attnzoo_transformer")
    hyps = _by_kind(_interactive(run, tmp_path, ["s1 s2 s3", "", "  "]), "H")
    assert hyps == {0: hyps[0], 1: "0.0\t", 2: "0.0\t"} and hyps[0].split("\t")[1], hyps


def test_lines_that_fit_are_translated_as_before(trained, tmp_path):
    """The same hypotheses as the lines translated on their own."""
    run = trained("attnzoo_transformer")
    alone = _by_kind(_interactive(run, tmp_path, ["s4 s5 s6"]), "H")
    mixed = _by_kind(_interactive(run, tmp_path, ["", "s4 s5 s6"]), "H")
    assert mixed[1] == alone[0]
