"""The demo's `subengine worker` processes: started, waited for, killed and stopped,
each logging to a file of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import subengine

WORKER_APP = "subengine.cli.demo_app:app"
WORKER_CONCURRENCY = 2


class Workers:
    """The demo's `subengine worker` processes, each logging to a file of its own."""

    def __init__(self, engine: subengine.Engine, directory: Path) -> None:
        self.directory = directory
        self.env = dict(os.environ, SUBENGINE_DSN=engine.dsn, SUBENGINE_SCHEMA=engine.schema)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.killed: set[int] = set()
        self._logs: list[IO[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        log = (self.directory / f"worker-{len(self.processes) + 1}.log").open("wb")
        self._logs.append(log)
        command = [sys.executable, "-m", "subengine.cli", "worker", "--app", WORKER_APP]
        process = subprocess.Popen(
            [*command, "--concurrency", str(WORKER_CONCURRENCY)],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the demo, which stops them in order
        )
        self.processes.append(process)
        return process

    def wait_registered(self, engine: subengine.Engine, timeout: float) -> list[str]:
        """Wait until every running worker has registered (it then handles SIGTERM)."""
        deadline = time.monotonic() + timeout
        while True:
            registered = {row.pid for row in engine.workers() if row.connected}
            waiting = [p for p in self.running() if p.pid not in registered]
            if not waiting:
                return self.failed()
            if time.monotonic() > deadline:
                pids = ", ".join(str(p.pid) for p in waiting)
                return [f"worker pids {pids} did not register within {timeout:g} s"]
            time.sleep(0.1)

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        self.killed.add(process.pid)
        process.send_signal(signal.SIGKILL)
        process.wait()

    def running(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.processes if p.poll() is None]

    def failed(self) -> list[str]:
        """What every worker that exited without being asked to said last."""
        return [
            f"worker pid {p.pid} exited with status {p.returncode}: {self.last_line(p)}"
            for p in self.processes
            if p.poll() is not None and p.pid not in self.killed
        ]

    def stop(self) -> list[str]:
        """SIGTERM every running worker; what went wrong if one did not exit 0."""
        stopping = self.running()
        for process in stopping:
            self.killed.add(process.pid)
            process.send_signal(signal.SIGTERM)
        problems = []
        for process in stopping:
            try:
                status = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                status = process.wait()
            if status != 0:
                problems.append(
                    f"worker pid {process.pid} exited with status {status} on SIGTERM: "
                    f"{self.last_line(process)}"
                )
        for log in self._logs:
            log.close()
        return problems

    def last_line(self, process: subprocess.Popen[bytes]) -> str:
        log = self.directory / f"worker-{self.processes.index(process) + 1}.log"
        lines = log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(it printed nothing)"
