"""The suite's own machinery: tests of one xdist group run in one worker process.

The Spark tests share one SparkSession and one database per process and rely on this;
pytest-xdist's `--dist loadgroup` has silently stopped grouping before (pytest 9.2).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from helpers import PYTHON

GROUPED = """
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("n", range(8))
def test_records_its_worker(n):
    out = Path(os.environ["WORKERS_SEEN"]) / f"{n}"
    out.write_text(os.environ.get("PYTEST_XDIST_WORKER", "none"))
"""


def test_a_group_runs_in_one_worker_under_loadgroup(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    seen = tmp_path / "seen"
    seen.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["WORKERS_SEEN"] = str(seen)
    result = subprocess.run(
        [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    workers = {path.read_text() for path in seen.iterdir()}
    assert len(list(seen.iterdir())) == 8
    assert len(workers) == 1, f"one group ran on {sorted(workers)}"
