"""The suite's `subengine` processes, forked from a process that has imported the command
already.

A `subengine` process spends 0.2-0.3 s of CPU importing its modules before it does
anything (psycopg alone 0.12 s), and the suite starts hundreds of them. So each pytest
process keeps one fork server: a Python process of this environment that imports the
command, its gateway and its worker once, then forks for every command a test starts. The
child is a real process of its own (its own pid, signals, file descriptors, environment,
working directory and exit status, and the connections it opens); only the interpreter's
start and the imports are shared. `popen` returns a `subprocess.Popen` whose pid is that
process, so tests wait for it, signal it and read its pipes as they would a process they
started themselves.

What a fork cannot show stays a real `exec` of the console script: what the command
imports, the interpreter's own start-up, the installed script (test_command_line,
test_packaging, test_worker_startup, the README and docs commands). SUBENGINE_TEST_FORK=0
runs every command as a fresh `exec`.

Run as a program, this module is the fork server: `python forked.py` with the listening
socket as file descriptor 3 and a pipe from its parent as standard input (end of file: the
parent is gone, so it exits).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import locale
import os
import pkgutil
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

_HEADER = struct.Struct("!I")
_STDIO = 3  # stdin, stdout and stderr travel with each request


def enabled() -> bool:
    return os.environ.get("SUBENGINE_TEST_FORK", "1") != "0"


# -- the test's side ---------------------------------------------------------------------

_server_lock = threading.Lock()
_server: tuple[subprocess.Popen[bytes], str] | None = None


def _server_path() -> str:
    """The fork server's socket, started on first use (one per pytest process)."""
    global _server
    with _server_lock:
        if _server is not None and _server[0].poll() is None:
            return _server[1]
        directory = tempfile.mkdtemp(prefix="fork-")
        path = os.path.join(directory, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
        # its stdin is a pipe whose write end only this process holds: when this process
        # ends, however it ends, the server reads end of file and exits
        process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            pass_fds=(listener.fileno(),),
            env=dict(os.environ, SUBENGINE_FORK_LISTENER=str(listener.fileno())),
        )
        listener.close()
        atexit.register(shutil.rmtree, directory, True)
        _server = (process, path)
        return path


class ForkedPopen(subprocess.Popen[Any]):
    """A `subprocess.Popen` of `subengine ARGS...` whose process the fork server forked.

    Popen's own constructor makes the pipes and file objects; this class only replaces how
    the child starts (a request to the fork server, with the child's ends of the pipes)
    and how its exit status arrives (a line from the server, which waits for the child).
    """

    _channel: socket.socket
    _received: bytes

    def _execute_child(
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: bool,
        pass_fds: Any,
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: int,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        restore_signals: bool,
        gid: Any,
        gids: Any,
        uid: Any,
        umask: int,
        start_new_session: bool,
        process_group: Any,
    ) -> None:
        if shell or executable or preexec_fn or pass_fds or gid or gids or uid or umask >= 0:
            raise ValueError(
                "a forked subengine process takes none of shell, executable, preexec_fn,"
                " pass_fds, user, group or umask"
            )
        if cwd is not None and not os.path.isdir(cwd):
            raise FileNotFoundError(2, "No such file or directory", os.fspath(cwd))
        stdio = [
            p2cread if p2cread != -1 else 0,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
        ]
        request = json.dumps(
            {
                "argv": [os.fspath(arg) for arg in args],
                "env": dict(os.environ if env is None else env),
                "cwd": None if cwd is None else os.fspath(cwd),
                "session": bool(start_new_session),
                "group": process_group,
            }
        ).encode()
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            channel.connect(_server_path())
            socket.send_fds(channel, [_HEADER.pack(len(request)) + request], stdio)
            self._channel, self._received = channel, b""
            self.pid = int(self._line(None))
        except BaseException:
            channel.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]
        self._child_created = True

    def _line(self, timeout: float | None) -> bytes:
        """The next line from the server; TimeoutError when none came within `timeout`."""
        while b"\n" not in self._received:
            self._channel.settimeout(timeout)
            chunk = self._channel.recv(64)
            if not chunk:
                raise ChildProcessError("the fork server went away")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line

    def _status(self, timeout: float | None) -> int | None:
        try:
            status = int(self._line(timeout))
        except (TimeoutError, BlockingIOError):
            return None
        self._channel.close()
        return os.waitstatus_to_exitcode(status)

    def _internal_poll(self, _deadstate: Any = None, *args: Any, **kwargs: Any) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._status(0)
            except (OSError, ValueError):
                if _deadstate is not None:
                    self.returncode = _deadstate
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None:
            status = self._status(timeout)
            if status is None:
                assert timeout is not None
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = status
        return self.returncode


# What the interpreter reads from the environment as it starts and a forked child can
# still apply: the import path, the standard streams' buffering, writing bytecode, the
# locale. Any other PYTHON* variable (the hash seed, warnings, the development mode...)
# shaped the fork server itself, so a command whose environment sets it otherwise is
# exec'd.
APPLIED = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONCOERCECLOCALE")


def forkable(env: dict[str, str] | None) -> bool:
    """Whether a command with environment `env` (None: this process's) can be forked: it
    sets every start-up variable the fork server cannot apply as the server's has it."""
    if env is None:
        return True
    names = {n for n in (*env, *os.environ) if n.startswith("PYTHON") and n not in APPLIED}
    return all(env.get(name) == os.environ.get(name) for name in names)


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(args, **kwargs)` for the `subengine` command `args` (its first
    item the console script): forked by the fork server, unless SUBENGINE_TEST_FORK=0 or
    its environment needs a fresh interpreter."""
    if not enabled() or not forkable(kwargs.get("env")):
        return subprocess.Popen(args, **kwargs)
    return ForkedPopen(args, **kwargs)


# -- the fork server's side --------------------------------------------------------------


def _preload() -> None:
    """What `subengine serve`, `subengine worker` and the one-shot commands import."""
    import psycopg  # noqa: F401
    import psycopg_pool  # noqa: F401
    import subengine.cli  # type: ignore[import-not-found]
    import uvicorn
    import uvicorn.lifespan.on
    import uvicorn.loops.auto
    import uvicorn.protocols.http.auto  # noqa: F401

    import subengine
    import subengine.db._migrate
    import subengine.gateway
    import subengine.worker

    for module in pkgutil.iter_modules(subengine.cli.__path__, "subengine.cli."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


def _serve() -> None:
    listener = socket.socket(fileno=int(os.environ.pop("SUBENGINE_FORK_LISTENER")))
    # the sys.path a console script of this environment starts with, but for its own
    # directory (first) and PYTHONPATH, which each child's environment says
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path if p not in own]
    _preload()
    # What every child inherits lives as long as it does: frozen, the children's full
    # collections skip it (and so do not touch, and copy, its pages), as a gateway
    # freezes its own once its app is made.
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters: the kernel reaps them
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(0, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj == 0:
                if not os.read(0, 4096):
                    return  # the pytest process is gone
                continue
            conn, _ = listener.accept()
            with conn:
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                if os.fork() == 0:
                    selector.close()
                    listener.close()
                    _wait_for_child(conn, request, fds, base)
                for fd in fds:
                    os.close(fd)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 65536, _STDIO)
    if len(fds) != _STDIO or len(data) < _HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request without its three file descriptors")
    (size,) = _HEADER.unpack_from(data)
    data = data[_HEADER.size :]
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("a cut request")
        data += chunk
    return json.loads(data), list(fds)


def _wait_for_child(
    conn: socket.socket, request: dict[str, Any], fds: list[int], base: list[str]
) -> None:
    """The waiter: forks the command, tells the client its pid and, once it exits, its
    wait status; never returns."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        pid = os.fork()
        if pid == 0:
            _run(conn, request, fds, base)
        for fd in fds:
            os.close(fd)
        conn.sendall(b"%d\n" % pid)
        _, status = os.waitpid(pid, 0)
        conn.sendall(b"%d\n" % status)
    finally:
        os._exit(0)


def _run(conn: socket.socket, request: dict[str, Any], fds: list[int], base: list[str]) -> None:
    """The command's process: what a fresh interpreter running the console script would
    have, then the command; never returns."""
    code = 1
    interrupted = False
    try:
        conn.close()
        if request["session"]:
            os.setsid()
        elif request["group"] is not None and request["group"] >= 0:
            os.setpgid(0, request["group"])
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        if request["cwd"] is not None:
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _start_as_python_does()
        argv = request["argv"]
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(argv[0]), *extra, *base]
        sys.argv = list(argv)
        from subengine.cli.main import main  # type: ignore[import-not-found]

        code = 0
        main()
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # what the interpreter does on its way out: wait for the threads that are not
    # daemons, run the atexit functions, flush the standard streams
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        sys.excepthook(*sys.exc_info())
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = 120
    if interrupted:
        # as Python ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _start_as_python_does() -> None:
    """What the interpreter's start does with a new environment: the C locale coerced to
    C.UTF-8 (PEP 538, which says so in LC_CTYPE), the character type locale and the time
    zone taken from it."""
    env = os.environ
    if "LC_ALL" not in env and env.get("PYTHONCOERCECLOCALE") != "0":
        if (env.get("LC_CTYPE") or env.get("LANG") or "C") in ("C", "POSIX"):
            env["LC_CTYPE"] = "C.UTF-8"
    try:
        locale.setlocale(locale.LC_CTYPE, "")
    except locale.Error:
        pass
    time.tzset()
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    _standard_streams(unbuffered=bool(env.get("PYTHONUNBUFFERED")))


# the fork server's own stream objects: they close their file descriptor when collected
_replaced: list[Any] = []


def _standard_streams(unbuffered: bool) -> None:
    """sys.stdin, stdout and stderr over file descriptors 0-2 as the interpreter makes
    them: buffered unless PYTHONUNBUFFERED, stderr and a terminal line by line."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        old = getattr(sys, name)
        _replaced.append(old)
        raw = io.FileIO(fd, mode, closefd=False)
        buffered: Any = raw
        if not (unbuffered and mode == "w"):
            buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffered,
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=not unbuffered and mode == "w" and (fd == 2 or raw.isatty()),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    # the tests' directory is this script's, and no child should import from it
    sys.path[0:1] = []
    _serve()
