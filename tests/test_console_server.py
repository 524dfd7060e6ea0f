"""tests/console_server.py runs a console script as its own process would: the same exit code,
the same stderr line for an error, and fairseq's log configured the same way (format, stream,
level), checked here against the real ``fairseq-train``."""

import os
import subprocess

from console_server import BIN, SERVERS
from zoo_testlib import tiny_flags

TRAIN = ["--max-tokens", "500", "--optimizer", "adam", "--lr", "1e-3", "--num-workers", "0",
         "--disable-validation", "--no-save", "--log-format", "json", "--log-interval", "1"]


def _kinds(text):
    """Each log line's level and logger (fairseq's format: time | level | name | message), or the
    line itself when it is not one, in order: what the two runs must share (times differ)."""
    out = []
    for line in text.splitlines():
        parts = line.split(" | ")
        out.append(tuple(parts[1:3]) if len(parts) >= 4 else line)
    return out


def test_a_command_runs_as_in_its_own_process(mt_data):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ATTNZOO_TRACEBACK", None)
    cwd = os.getcwd()  # the test's own folder
    for argv, merge in ((["--max-update", "1"], True),  # trains: its log on stdout
                        (["--pkm-knn", "32"], False)):  # our one-line error on stderr
        argv = [*tiny_flags("transformer_pkm", mt_data), *TRAIN, *argv]
        real = subprocess.run([os.path.join(BIN, "fairseq-train"), *argv], env=env, cwd=cwd,
                              stdout=subprocess.PIPE, text=True, timeout=300,
                              stderr=subprocess.STDOUT if merge else subprocess.PIPE)
        code, out, err = SERVERS.run("fairseq-train", argv, env=env, cwd=cwd, merge=merge)
        assert code == real.returncode
        if merge:
            assert code == 0, out[-2000:]
            assert _kinds(out) == _kinds(real.stdout)
            assert any("| INFO | fairseq_cli.train |" in line for line in out.splitlines())
        else:
            assert code != 0 and err == real.stderr and "--pkm-knn" in err


def test_a_shim_runs_the_command_with_the_callers_streams_and_exit_code(tmp_path):
    """A shim (what a shell runs: the documented commands' test puts them on PATH) writes to the
    caller's own stdout and stderr -- a pipe here -- and exits with the command's code."""
    shims = SERVERS.shims(str(tmp_path / "bin"), ["fairseq-train"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for argv in (["--help"], ["--no-such-flag"]):  # (stock: its parser's RuntimeError)
        real = subprocess.run([os.path.join(BIN, "fairseq-train"), *argv], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        shim = subprocess.run(["bash", "-o", "pipefail", "-c", 'fairseq-train "$@" | cat', "bash",
                               *argv], env=dict(env, PATH=f"{shims}:{env['PATH']}"),
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert (shim.returncode, shim.stdout) == (real.returncode, real.stdout)
        assert shim.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:]
    assert real.returncode == 1 and real.stderr.splitlines()[-1] == "RuntimeError"


def test_python_c_runs_as_in_its_own_interpreter(tmp_path):
    """``-c`` (test_compat_table's and test_plain_torch's scenarios): the code sees what ``python
    -c CODE ARGS`` gives it -- argv, ``sys.path[0]``, ``__name__``, the working directory, the
    environment -- and an uncaught error ends it as there (the traceback's last line, exit 1)."""
    import sys

    code = ("import json, os, sys\n"
            "print(json.dumps([sys.argv, sys.path[0], __name__, os.getcwd(),\n"
            "                  os.environ.get('ZOO_PROBE')]))\n"
            "if sys.argv[1:] == ['fail']:\n"
            "    raise ValueError('from the code')\n")
    env = dict(os.environ, ZOO_PROBE="seen")
    for argv in (["a", "b"], ["fail"]):
        real = subprocess.run([sys.executable, "-c", code, *argv], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        got = SERVERS.run("-c", [code, *argv], env=env, cwd=tmp_path, timeout=60)
        assert got[:2] == (real.returncode, real.stdout), (got, real)
        assert got[2].splitlines()[-1:] == real.stderr.splitlines()[-1:], (got, real)
    assert real.returncode == 1 and real.stderr.splitlines()[-1] == "ValueError: from the code"


def test_a_killed_shim_takes_its_command_with_it(tmp_path):
    """SIGKILL to a shim (a test's timeout, ``proc.kill()``) ends its command as it would end the
    command's own process: a command left running trained on for about 45 minutes on one core
    after a Ctrl-C test timed out."""
    import signal
    import time

    script = tmp_path / "forever.py"
    script.write_text("import os, sys, time\n"
                      "if __name__ == '__main__':\n"
                      "    open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                      "    while True:\n"
                      "        time.sleep(0.05)\n")
    pid_file = tmp_path / "pid"
    shim = SERVERS.shim(str(tmp_path / "bin"), str(script))
    proc = subprocess.Popen([shim, str(pid_file)])
    try:
        for _ in range(600):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        proc.kill()
        proc.wait(timeout=10)
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the command outlived its killed shim")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_python_shim_runs_its_modules_and_what_they_start_with_sys_executable(tmp_path):
    """``SERVERS.python_shim``: ``python -m MODULE`` of its modules runs through their servers
    (started in the given folder, where the module is imported from), with the shim as
    ``sys.executable``, so a ``sys.executable -m MODULE`` the command starts goes through it too;
    anything else is the interpreter itself."""
    import sys

    (tmp_path / "probe.py").write_text(
        "import subprocess, sys\n"
        "if __name__ == '__main__':\n"
        "    print(sys.argv[1], sys.executable, __file__, flush=True)\n"
        "    if sys.argv[1] == 'parent':\n"
        "        subprocess.run([sys.executable, '-m', 'probe', 'child'], check=True)\n")
    folder = SERVERS.python_shim(str(tmp_path / "bin"), ["probe"], cwd=tmp_path)
    python = os.path.join(folder, "python")
    run = subprocess.run([python, "-m", "probe", "parent"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    probe = str(tmp_path / "probe.py")
    assert run.stdout.splitlines() == [f"parent {python} {probe}", f"child {python} {probe}"]
    other = subprocess.run([python, "-c", "import sys; print(sys.executable)"],
                           capture_output=True, text=True, timeout=60)
    assert other.stdout.strip() == sys.executable
