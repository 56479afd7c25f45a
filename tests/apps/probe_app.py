"""Not an app: a module whose import shows what its process was given, for the tests of
the fork server (tests/unit/test_forked.py). `subengine worker --app probe_app:app`
imports it before anything else it does; PROBE says what to do there."""

import atexit
import io
import json
import os
import sys
import threading
import time
from typing import cast

probe = os.environ.get("PROBE", "facts")
if probe == "facts":
    print(
        json.dumps(
            {
                "argv": sys.argv,
                "env": dict(os.environ),
                "cwd": os.getcwd(),
                "path": sys.path[:3],
                "stdin": sys.stdin.read(),
                "session": os.getsid(0) == os.getpid(),
                "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
                "tz": time.strftime("%Z"),
                "stdio": [
                    [
                        type(stream.buffer).__name__,
                        stream.line_buffering,
                        stream.write_through,
                        stream.encoding,
                        stream.errors,
                    ]
                    for stream in cast(
                        "list[io.TextIOWrapper]", [sys.stdin, sys.stdout, sys.stderr]
                    )
                ],
                "bytecode": not sys.dont_write_bytecode,
            }
        )
    )
    print("to stderr", file=sys.stderr)
    sys.exit(0)
elif probe.startswith("exit:"):
    sys.exit(int(probe.removeprefix("exit:")))
elif probe == "message":
    sys.exit("a message instead of a status")
elif probe == "raise":

    class Unexpected(BaseException):
        pass

    raise Unexpected("raised at import")
elif probe == "interrupt":
    raise KeyboardInterrupt
elif probe == "shutdown":
    atexit.register(print, "atexit ran", flush=True)

    def late() -> None:
        time.sleep(0.3)
        print("thread finished", flush=True)

    threading.Thread(target=late).start()
    print("unflushed at exit", end="")
    sys.exit(3)
elif probe == "wait":
    print("waiting", flush=True)
    time.sleep(600)
