"""`pip install .` builds a real wheel whose `subengine` command works and finds migrations."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

from subengine.db import _migrate

# One xdist worker builds the wheel for both tests: setuptools builds in the source
# tree's build/ folder, and two builds at once collide there ("File exists:
# build/bdist.linux-x86_64/wheel/subengine-0.1.0.dist-info", reproduced with two
# concurrent `pip wheel` of the tree); it failed the suite once on two workers.
pytestmark = pytest.mark.xdist_group("packaging")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    [built] = out.glob("subengine-*.whl")
    return built


def test_wheel_maps_cli_and_migrations_under_the_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("cli/", "migrations/", "tests/"))]
    for expected in (
        "subengine/__init__.py",
        "subengine/db/sql/queries.sql",
        "subengine/gateway/ui/index.html",
        "subengine/gateway/ui/app.js",
        "subengine/gateway/ui/vendor/uPlot.iife.min.js",
        "subengine/gateway/ui/vendor/uPlot.LICENSE.txt",
        "subengine/spark/__init__.py",
        "subengine/cli/main.py",
        "subengine/migrations/env.py",
        "subengine/migrations/versions/0001_streams.py",
    ):
        assert expected in names


def test_installed_command_migrates_from_the_wheel(
    wheel: Path, tmp_path: Path, blank_dsn: str
) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    # The wheel's code first, this environment's dependencies after it; run from an empty
    # directory so nothing resolves to the source tree.
    env = dict(os.environ, PYTHONPATH=str(target), SUBENGINE_DSN=blank_dsn)
    code = (
        "import sys, subengine.cli.main as m, subengine;"
        "assert 'site' in subengine.__file__, subengine.__file__;"
        "sys.argv = ['subengine', 'migrate']; m.main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"is at revision {_migrate.head_revision()}" in result.stdout
    script = (target / "bin" / "subengine").read_text()
    assert "from subengine.cli.main import main" in script
