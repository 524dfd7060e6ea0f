"""Run commands without paying their imports each time (tests only).

A ``fairseq-*`` script's process spends about 3 s of its start importing torch and fairseq (its
first line, ``from fairseq_cli.train import cli_main``, imports the whole ``fairseq`` package),
and about 1 s more where it builds its first optimizer (``torch.optim`` imports ``torch._dynamo``
then). The server of a program -- a console script, a script's path, or ``-m MODULE`` -- runs it
once as a module, which does its imports and nothing else (its main is under ``if __name__ ==
"__main__"``; ``-c``, for ``python -c CODE``, has no module: its code comes with each command),
imports any modules it is asked to preload, then listens on a Unix socket and runs each command
in a child forked from that state, so each command still has its own process: its argv,
environment (and PYTHONPATH on its ``sys.path``), working directory, and the standard input,
output and error of whoever asked (their file descriptors travel with the request), buffered as
a fresh interpreter would buffer them. The child runs the program as ``__main__`` and ends as the
interpreter ends a script: an uncaught exception goes to ``sys.excepthook``, atexit handlers run,
the exit code is ``sys.exit``'s. test_console_server.py checks a command and a shim against the
real script.

The servers are forked in turn from one base process (a :class:`ConsoleServer`'s), which did once
the imports they share (:data:`BASE_IMPORTS`: torch, ``torch._dynamo``, and the two libraries
that take longest in fairseq's import); fairseq itself is each program's own import, since its
modules configure logging as they load. A server's start then costs what its program imports
besides (under 1 s for a ``fairseq-*`` script; a fresh server paid 3-6 s).

    # SERVERS: this test process's (a program's server starts on its first use)
    code, out, err = SERVERS.run("fairseq-train", argv, env=..., cwd=..., merge=False)
    SERVERS.shims(folder, ["fairseq-train", ...])  # executables that run through the servers,
                                                  # for commands that a shell or torchrun
                                                  # starts: put first on PATH (conftest's
                                                  # console_shims fixture)
"""

import atexit
import builtins
import hashlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile

import hydra_testlib

BIN = os.path.dirname(sys.executable)
#: ``python -m torch.distributed.run`` (torchrun) as a program of :meth:`ConsoleServer.run`
TORCHRUN = "-m torch.distributed.run"

#: what a shim runs: its argv, environment, folder and standard streams to the server, the exit
#: code back; a signal it gets (Ctrl-C, a timeout's kill) goes on to the command
SHIM_CLIENT = '''
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(path)
request = dict(argv=argv, env=dict(os.environ), cwd=os.getcwd(), executable=executable)
socket.send_fds(s, [json.dumps(request).encode()], [0, 1, 2])
pid = json.loads(s.recv(4096))["pid"]
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda n, frame: os.kill(pid, n))
code = json.loads(s.recv(4096))["code"]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''
SHIM = '''#!{python} -S
import json, os, signal, socket, sys
path, argv, executable = {path!r}, sys.argv[1:], None
''' + SHIM_CLIENT
#: ``python`` for a shell or a script that runs ``python -m MODULE ARGS``: the modules it was made
#: for run through their servers, with the shim as their ``sys.executable`` (a ``sys.executable
#: -m MODULE`` they start goes through it too); anything else is this interpreter itself
PYTHON_SHIM = '''#!{python} -S
import json, os, signal, socket, sys
sockets, argv, executable = {sockets!r}, sys.argv[1:], os.path.abspath(sys.argv[0])
if len(argv) < 2 or argv[0] != "-m" or argv[1] not in sockets:
    os.execv({python!r}, [{python!r}, *argv])
path, argv = sockets[argv[1]], argv[2:]
''' + SHIM_CLIENT


class ConsoleServer:
    def __init__(self, env=None):
        """``env``: the servers' own environment (default: this process's); each command still
        runs with the environment it is given."""
        self.env = env
        self.base = None  # the process the servers are forked from
        self.servers = {}  # socket name -> its server's pid
        # abstract socket names (Linux, "\0" in front): nothing on disk to clean up or leave
        self.prefix = f"attnzoo-console-{os.getpid()}-{id(self)}-"

    def socket(self, program, preload=(), cwd=None) -> str:
        """The socket of ``program``'s server (started if it is not running): a console script
        of this Python's bin folder, a script's absolute path, ``-m MODULE`` (what ``python -m
        MODULE`` runs in ``cwd``) or ``-c`` (``python -c CODE``: the code is the command's first
        argument), its server importing the modules of ``preload`` too."""
        return self._start([program], preload, cwd)[0]

    def _base(self) -> str:
        """The socket of the base process (started if it is not running), which forks the
        servers."""
        name = self.prefix + "base"
        if self.base is None or self.base.poll() is not None:
            self.base = subprocess.Popen([sys.executable, __file__, "--base", name],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, env=self.env)
            atexit.register(_stop, self.base)
            assert self.base.stdout.readline().strip() == "listening", \
                "the console servers' base process did not start"
        return "\0" + name

    def close(self):
        """End the base process and its servers (else they end with this process)."""
        if self.base is not None:
            _stop(self.base)
            self.base = None
            self.servers.clear()

    def _start(self, programs, preload=(), cwd=None, own_folder=False):
        """Start the servers of ``programs`` that are not running (at once: each does its
        imports), wait until they listen; their sockets. ``own_folder``: servers of their own
        for ``cwd`` (a ``-m`` module imports from the folder its server starts in)."""
        started, paths, cwd = [], [], str(cwd or os.getcwd())
        for program in programs:
            key = " ".join([program, *preload, *([cwd] if own_folder else [])])
            name = self.prefix + hashlib.sha1(key.encode()).hexdigest()[:12]  # (108 bytes at most)
            paths.append("\0" + name)
            if not _alive(self.servers.get(name)):
                target = (program if program.startswith("-") or os.path.isabs(program) else
                          os.path.join(BIN, program))
                ask = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                ask.connect(self._base())
                ask.sendall(json.dumps(dict(target=target, name=name, preload=list(preload),
                                            cwd=cwd, env=dict(self.env or os.environ))).encode())
                started.append((program, name, ask))
        for program, name, ask in started:
            with ask:
                reply = ask.recv(4096)
            assert reply, f"the console server of {program} did not start"
            self.servers[name] = json.loads(reply)["pid"]
        return paths

    def shims(self, folder, programs) -> str:
        """An executable in ``folder`` for each console script (or script path) of ``programs``,
        named as the script, that runs it through its server, as the script would run (put
        ``folder`` first on PATH, or give torchrun ``--no-python`` and its path). Returns
        ``folder``."""
        os.makedirs(folder, exist_ok=True)
        for program, socket_path in zip(programs, self._start(programs)):
            path = os.path.join(folder, os.path.basename(program))
            with open(path, "w") as f:
                f.write(SHIM.format(python=sys.executable, path=socket_path))
            os.chmod(path, 0o755)
        return folder

    def python_shim(self, folder, modules, cwd=None) -> str:
        """A ``python`` in ``folder`` (put it first on PATH) that runs ``python -m MODULE ARGS``
        through MODULE's server for each of ``modules`` (servers of ``cwd``'s own, where they
        import), with the shim as the command's ``sys.executable``, and execs this interpreter
        for anything else. Returns ``folder``."""
        os.makedirs(folder, exist_ok=True)
        sockets = dict(zip(modules, self._start([f"-m {m}" for m in modules], cwd=cwd,
                                                own_folder=True)))
        path = os.path.join(folder, "python")
        with open(path, "w") as f:
            f.write(PYTHON_SHIM.format(python=sys.executable, sockets=sockets))
        os.chmod(path, 0o755)
        return folder

    def shim(self, folder, program) -> str:
        """The path of ``program``'s shim in ``folder`` (:meth:`shims`), e.g. for ``torchrun
        --no-python``."""
        return os.path.join(self.shims(folder, [program]), os.path.basename(program))

    def run(self, program, argv, env, cwd, merge=False, timeout=300, preload=()):
        """Run ``program`` (a console script of this Python's bin folder, a script's absolute
        path, ``-m MODULE``, or ``-c`` with the code first in ``argv``) with ``argv``: (exit code,
        stdout, stderr); with ``merge`` stderr goes to stdout (and the third item is empty).
        ``preload``: modules its server imports besides the program's own."""
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
                open(os.devnull) as stdin, \
                socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(self.socket(program, preload, cwd))
            request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd)}
            fds = [stdin.fileno(), out.fileno(), (out if merge else err).fileno()]
            socket.send_fds(s, [json.dumps(request).encode()], fds)
            pid = json.loads(s.recv(4096))["pid"]
            s.settimeout(timeout)
            try:
                reply = s.recv(4096)
            except socket.timeout:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"{program} {argv} ran past {timeout} s") from None
            assert reply, f"the console server of {program} died"
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read())
        return json.loads(reply)["code"], texts[0], texts[1]


#: the servers of this test process
SERVERS = ConsoleServer()


def _stop(proc):
    """A server ends with its input."""
    proc.stdin.close()
    proc.stdout.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _exit_code(code) -> int:
    """What the interpreter makes of ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _script(target, argv) -> int:
    try:
        if target == "-c":  # as `python -c CODE ARGS...`: a fresh __main__, argv[0] "-c"
            sys.argv = ["-c", *argv[1:]]
            main = sys.modules["__main__"] = type(sys)("__main__")
            main.__builtins__ = builtins
            exec(compile(argv[0], "<string>", "exec"), main.__dict__)
        elif target.startswith("-m "):
            sys.argv = [target, *argv]  # (runpy puts the module's file first)
            runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *argv]
            runpy.run_path(target, run_name="__main__")
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


def _enter(cwd, env):
    """Work in ``cwd`` with exactly the environment ``env`` (TMPDIR as it says)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None


def _on_path(first=None):
    """``sys.path`` as an interpreter started here would have it: ``first`` in front (None:
    as it is), then the entries of PYTHONPATH."""
    if first is not None:
        sys.path[0] = first
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in extra if p not in sys.path]


def _child(target, request, fds):
    try:
        _enter(request["cwd"], request["env"])
        if request.get("executable"):  # (a python shim's command)
            sys.executable = request["executable"]
        _on_path(os.getcwd() if target.startswith("-m ") else None)  # (as `python -m` puts it)
        for std, fd in enumerate(fds):
            os.dup2(fd, std)
            os.close(fd)
        # buffered as a fresh interpreter would buffer them (the same objects: logging's
        # handlers made at import hold them): a line at a time on a terminal or under
        # PYTHONUNBUFFERED, which also writes through
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdout.reconfigure(line_buffering=unbuffered or os.isatty(1), write_through=unbuffered)
        sys.stderr.reconfigure(line_buffering=True, write_through=unbuffered)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        code = _script(target, request["argv"])
    except BaseException:  # the server's own failure: say so on the child's stderr
        import traceback

        traceback.print_exc()
        code = 70
    os._exit(code)


def _alive(pid) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


#: what the base process imports for every server: torch with ``torch._dynamo`` (what an optimizer
#: imports) and the two libraries of fairseq's import that take longest (fairseq/criterions/
#: sentence_prediction.py's sklearn.metrics and scipy.stats) -- neither configures logging, unlike
#: fairseq's own modules (whose ``logging.basicConfig`` calls must come after a script's own)
BASE_IMPORTS = ("torch._dynamo", "sklearn.metrics", "scipy.stats")


def _base(name):
    """The base process: :data:`BASE_IMPORTS` done once; each request (a server's target,
    socket name, preload, folder and environment) forks a server (:func:`_serve`), which
    answers the request with its pid once it listens. Ends with its input, as its servers do."""
    import logging

    for module in BASE_IMPORTS:
        importlib.import_module(module)
    assert not logging.root.handlers and logging.root.level == logging.WARNING, \
        "an import of the console servers' base configured logging: a command's log would not " \
        "be its own process's"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of a test run: the commands' business
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(64)
    print("listening", flush=True)
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.5)
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            break
        while True:  # (servers end with the input they share with this process)
            try:
                if not os.waitpid(-1, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
        if listener in ready:
            conn, _ = listener.accept()
            request = json.loads(conn.recv(1 << 20))
            pid = os.fork()
            if pid == 0:
                listener.close()
                try:
                    _serve(conn=conn, **request)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                os._exit(70)
            conn.close()


def _serve(target, name, preload, cwd, env, conn):
    """A server (in a child of :func:`_base`): ``target``'s imports and ``preload``'s in
    ``cwd`` and ``env``, as its own interpreter would do them; its pid to ``conn`` once it
    listens; then a child forked for each command."""
    _enter(cwd, env)
    if target == "-c":  # code comes with each command; sys.path[0] as `python -c` puts it
        _on_path("")
    elif target.startswith("-m "):  # the module's imports (its main is under __name__ == ...)
        _on_path(os.getcwd())
        runpy.run_module(target[3:], run_name="__console_server__")
    else:  # the script's imports
        _on_path(os.path.dirname(target))  # as when the script itself runs, not this file
        runpy.run_path(target, run_name="__console_server__")
    for module in preload:
        importlib.import_module(module)
    if target not in COMPOSE_NOTHING:
        _first_config()

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of a test run: the commands' business
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind("\0" + name)
    server.listen(64)
    conn.sendall(json.dumps({"pid": os.getpid()}).encode())  # (listening)
    conn.close()
    running = {}  # child pid -> the connection its exit code goes to
    # a command's end wakes the select below (SIGCHLD writes to `wake`): idle, a server sleeps
    wake, woken = os.pipe()
    os.set_blocking(woken, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(woken)
    while True:
        ready, _, _ = select.select([server, sys.stdin, wake, *running.values()], [], [])
        if wake in ready:
            os.read(wake, 4096)
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            break  # our input closed: the test process is done
        for pid, conn in running.items():
            if conn in ready:  # its caller hung up (a killed shim, a test's timeout): the
                os.kill(pid, signal.SIGKILL)  # command dies with it, as its own process would
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            _reply(running.pop(pid), code=os.waitstatus_to_exitcode(status))
        if server not in ready:
            continue
        conn, _ = server.accept()
        conn.settimeout(None)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for s in (server, conn, *running.values()):
                s.close()
            for fd in (wake, woken):
                os.close(fd)
            _child(target, request, fds)
        for fd in fds:
            os.close(fd)
        running[pid] = conn
        _reply(conn, pid=pid)
    for pid in running:  # the test process is done: nothing waits for these any more
        os.kill(pid, signal.SIGKILL)


#: programs whose commands compose no fairseq config (:func:`_first_config` would be wasted)
COMPOSE_NOTHING = {os.path.join(BIN, "fairseq-preprocess"), "-m fairseq_cli.preprocess",
                   os.path.join(BIN, "attnzoo-archs"), "-m fairseq_attnzoo.cli.archs"}


def _first_config():
    """Where the program imported fairseq, compose fairseq's config once, as a command's first
    config would: hydra then has found its plugins, made its lazy imports and built its parser's
    tables, and ``inspect`` knows the modules' files (hydra's ``initialize`` looks up its
    caller's module), in this process rather than in each command's child -- a fairseq command's
    config then takes about 0.35 s instead of 0.8 s; with hydra's override parser memoised and
    its ConfigStore read, not copied (tests/hydra_testlib.py), about 0.2 s. Nothing of it is
    left that a command could see: no warning or log line, hydra not initialized, the warnings
    filters as they were."""
    if "fairseq" not in sys.modules:
        return
    hydra_testlib.quicker_compose()
    import inspect
    import logging
    import warnings

    import fairseq
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    config = os.path.join(os.path.dirname(fairseq.__file__), "config")
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with hydra.initialize_config_dir(config_dir=config, version_base="1.1"):
                hydra.compose("config", overrides=["common.seed=1"])
            inspect.getmodule(compile("0", "<first config>", "eval"))
    finally:
        logging.disable(disabled)
    assert not GlobalHydra.instance().is_initialized(), "the first config left hydra initialized"


def _reply(conn, **message):
    """Send ``message`` (to a client that may be gone: its command was killed)."""
    try:
        conn.sendall(json.dumps(message).encode())
        if "code" in message:
            conn.close()
    except OSError:
        conn.close()


if __name__ == "__main__":
    _base(sys.argv[2])  # (--base NAME)
