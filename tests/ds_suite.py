"""The pinned npm packages of the Durable Streams tests (tests/conformance/package.json):
the official conformance suite and TypeScript client, installed once into a cache folder
outside the repository (`$XDG_CACHE_HOME/subengine`, or `~/.cache/subengine`)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

WRAPPER = Path(__file__).parent / "conformance"
WRAPPER_FILES = ("package.json", "durable-streams.test.mjs", "vitest.config.mjs", "interop.mjs")
INSTALL_SECONDS = 600
MIN_NODE = 20


def suite_folder() -> Path:
    """The cache folder of the pinned packages, installed there when missing; skips
    the test when node or npm is missing."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed (Debian: apt-get install nodejs npm)")
    version = subprocess.run(["node", "--version"], capture_output=True, text=True, timeout=30)
    major = version.stdout.strip().lstrip("v").split(".")[0]
    if not major.isdecimal() or int(major) < MIN_NODE:
        pytest.skip(f"vitest 4 needs Node {MIN_NODE} or later, not {version.stdout.strip()!r}")
    pins = (WRAPPER / "package.json").read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "subengine"
    folder = cache / f"durable-streams-conformance-{hashlib.sha256(pins).hexdigest()[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pytest process may be installing
        for name in WRAPPER_FILES:
            _put(WRAPPER / name, folder / name)
        installed = folder / "node_modules" / ".subengine-installed"
        if not installed.exists():
            done = subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"],
                cwd=folder,
                capture_output=True,
                text=True,
                timeout=INSTALL_SECONDS,
            )
            if done.returncode != 0:
                pytest.fail(f"npm install of the conformance suite failed:\n{done.stderr[-3000:]}")
            installed.touch()
    return folder


def _put(source: Path, target: Path) -> None:
    """Copy `source` to `target` unless it holds the same bytes already, by a rename: a
    node process of another pytest session reading `target` meanwhile sees the old file
    or the new one, never a truncated one (an empty script runs, prints nothing and
    exits 0)."""
    content = source.read_bytes()
    if target.exists() and target.read_bytes() == content:
        return
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.write_bytes(content)
    partial.replace(target)
