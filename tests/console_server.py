"""Run console scripts without paying their imports each time (tests only).

A ``fairseq-*`` script's process spends about 2.5 s of its start importing torch and fairseq (its
first line, ``from fairseq_cli.train import cli_main``, imports the whole ``fairseq`` package).
The server of a script runs the script file once as a module, which does its imports and nothing
else (the script's main is under ``if __name__ == "__main__"``), then runs each command in a child
forked from that state, so each command still has its own process: its argv, environment, working
directory, stdin ``/dev/null`` and stdout/stderr. The child runs the script file as ``__main__``
and ends as the interpreter ends a script: an uncaught exception goes to ``sys.excepthook``,
atexit handlers run, the exit code is ``sys.exit``'s. test_console_server.py checks it against
the real script.

    servers = ConsoleServer()   # one per test process; a script's server starts on its first use
    code, out, err = servers.run("fairseq-train", argv, env=..., cwd=..., merge=False)
"""

import atexit
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time

BIN = os.path.dirname(sys.executable)


class ConsoleServer:
    def __init__(self):
        self.procs = {}  # script path -> its server

    def run(self, program, argv, env, cwd, merge=False, timeout=300):
        """Run console script ``program`` (in this Python's bin folder) with ``argv``: (exit code,
        stdout, stderr); with ``merge`` stderr goes to stdout (and the third item is empty)."""
        script = os.path.join(BIN, program)
        proc = self.procs.get(script)
        if proc is None or proc.poll() is not None:
            proc = self.procs[script] = subprocess.Popen(
                [sys.executable, __file__, script], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True)
            atexit.register(proc.stdin.close)  # a server ends with its input
        request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd), "merge": merge,
                   "timeout": timeout}
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        reply = proc.stdout.readline()
        assert reply, f"the console server of {program} died"
        reply = json.loads(reply)
        assert not reply["timed_out"], f"{program} {argv} ran past {timeout} s"
        return reply["code"], reply["out"], reply["err"]


def _exit_code(code) -> int:
    """What the interpreter makes of ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _script(path, argv) -> int:
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _child(script, request, out_path, err_path):
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        out = os.open(out_path, os.O_WRONLY)
        os.dup2(out, 1)
        os.dup2(out if request["merge"] else os.open(err_path, os.O_WRONLY), 2)
        code = _script(script, request["argv"])
    except BaseException:  # the server's own failure: say so on the child's stderr
        import traceback

        traceback.print_exc()
        code = 70
    os._exit(code)


def _serve(script):
    sys.path[0] = os.path.dirname(script)  # as when the script itself is run, not this file
    runpy.run_path(script, run_name="__console_server__")  # the script's imports

    # mkdtemp, not TemporaryDirectory: its finalizer is an atexit handler, which the child runs
    folder = tempfile.mkdtemp(prefix="console-server-")
    paths = [os.path.join(folder, name) for name in ("out", "err")]
    try:
        for line in sys.stdin:
            request = json.loads(line)
            for p in paths:
                open(p, "w").close()
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(script, request, *paths)
            deadline, status, timed_out = time.monotonic() + request["timeout"], None, False
            while status is None:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = raw
                elif time.monotonic() > deadline:
                    os.kill(pid, 9)
                    status, timed_out = os.waitpid(pid, 0)[1], True
                else:
                    time.sleep(0.01)
            texts = []
            for p in paths:
                with open(p, errors="replace") as f:
                    texts.append(f.read())
            reply = {"code": os.waitstatus_to_exitcode(status), "out": texts[0], "err": texts[1],
                     "timed_out": timed_out}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    _serve(sys.argv[1])
