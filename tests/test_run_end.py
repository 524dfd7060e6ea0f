"""Where a fairseq-train run stands (compat entries fairseq_train_summary and
fairseq_train_progress_in_log): a finished run ends with its best validation result, its best
checkpoint and the command that scores it (the command runs as printed); a run whose log goes to
a file or a pipe writes fairseq's simple progress lines into it every --log-interval updates,
even when stderr is a terminal (fairseq drew its tqdm bar there, and the log had nothing between
epoch lines)."""

import os
import shlex
import subprocess

import pytest

from zoo_testlib import TRAINED_UPDATES as N, json_logs, run_cli, sweep_train_flags


@pytest.mark.parametrize("arch,kind", [("attnzoo_transformer", "H-"), ("attnzoo_lm", "Loss")])
def test_a_finished_run_ends_with_its_summary_and_the_command_that_scores_it(arch, kind, trained):
    run = trained(arch)  # (the shared tiny fairseq-train run: its log and its folder)
    data, save, logs = run.data, run.folder, run.logs
    summary = [x for x in logs if x.startswith("[fairseq_attnzoo.summary]")]
    assert len(summary) == 2, logs[-5:]
    valid = json_logs(logs, "valid")
    assert [v["valid_num_updates"] for v in valid] == [str(N)], valid
    assert f"best checkpoint {save}/checkpoint_best.pt (update {N})" in summary[0], summary
    assert (f"run summary: best valid loss {float(valid[0]['valid_loss']):.4g} at update {N} "
            "(epoch 1)") in summary[0], (summary, valid)
    command = shlex.split(summary[1].split("score it: ", 1)[1])
    program = "generate" if arch == "attnzoo_transformer" else "eval_lm"
    assert command[:2] == [f"fairseq-{program.replace('_', '-')}", data] and "--cpu" in command
    out = run_cli(program, command[1:] + ["--max-tokens", "400"])  # as printed
    assert any(kind in line for line in out), out[-5:]


def test_a_run_that_saves_nothing_says_so(mt_data, tmp_path):
    logs = run_cli("train", sweep_train_flags("attnzoo_transformer", mt_data,
                                              str(tmp_path / "ckpt"), 2) + ["--no-save"])
    summary = [x for x in logs if x.startswith("[fairseq_attnzoo.summary]")]
    assert len(summary) == 1 and "at update 2" in summary[0], summary
    assert "nothing was saved (--no-save): no checkpoint to score" in summary[0]


def _train_with_stderr_on_a_terminal(shims, data, folder, disabled=""):
    """fairseq-train (its shim in ``shims``: the command gets the shim's own streams) with its
    log (stdout) in a pipe and stderr on a pseudo-terminal: stdout."""
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, OMP_NUM_THREADS="1", ATTNZOO_COMPAT_DISABLE=disabled)
    flags = sweep_train_flags("attnzoo_transformer", data, str(folder), 6)
    flags = [f for f in flags if f not in ("--log-format", "json")]  # fairseq's default format
    try:
        run = subprocess.run([os.path.join(shims, "fairseq-train"), *flags, "--log-interval", "2"],
                             stdout=subprocess.PIPE, stderr=slave, text=True, env=env,
                             timeout=300, cwd=folder.parent)
    finally:
        os.close(slave)
        os.close(master)
    assert run.returncode == 0, run.stdout[-2000:]
    return run.stdout.splitlines()


def test_a_log_that_is_not_a_terminal_gets_a_progress_line_every_log_interval(mt_data,
                                                                               console_shims,
                                                                               tmp_path):
    shims = console_shims("fairseq-train")
    lines = _train_with_stderr_on_a_terminal(shims, mt_data, tmp_path / "a")
    inner = [x for x in lines if "| train_inner |" in x]
    assert [x.split("num_updates=")[1].split(",")[0] for x in inner] == ["2", "4", "6"], inner
    # the switch: fairseq's own choice, a tqdm bar on the terminal and nothing in the log
    lines = _train_with_stderr_on_a_terminal(shims, mt_data, tmp_path / "b",
                                             "fairseq_train_progress_in_log")
    assert not [x for x in lines if "| train_inner |" in x]


def test_where_training_ran_in_spawned_processes_the_best_checkpoint_tells(trained):
    """fairseq spawns one process per GPU and the summary is printed by the process that started
    them, which validated nothing itself: the best checkpoint's own validation is the line."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_attnzoo.compat.run_end import summary_lines

    run = trained("attnzoo_transformer")
    flags = sweep_train_flags("attnzoo_transformer", run.data, run.folder, N)  # (the run's own)
    valid = json_logs(run.logs, "valid")
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(
        options.get_training_parser(), flags))
    head, command = summary_lines(cfg, [])
    assert head == (f"run summary: best valid loss {float(valid[0]['valid_loss']):.4g} at update "
                    f"{N} (epoch 1); best checkpoint {run.folder}/checkpoint_best.pt (update {N})")
    assert command.startswith(f"score it: fairseq-generate {run.data} --user-dir ")


def test_fairseq_can_still_send_train_main_to_spawned_processes():
    """fairseq's multi-GPU start pickles fairseq_cli.train.main into each process it spawns: the
    summary wraps call_main, never main, which must stay fairseq's own function."""
    import pickle

    import fairseq_cli.train

    from fairseq_attnzoo import compat

    assert compat.status()["fairseq_train_summary"] == compat.APPLIED
    assert pickle.loads(pickle.dumps(fairseq_cli.train.main)) is fairseq_cli.train.main
