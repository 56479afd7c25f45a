"""The Spark extra from the outside: the core without PySpark, and docs/spark.md's example
job run as its page shows.

Kept apart from test_spark.py: these start processes of their own (the job starts its own
Spark), so they need neither that module's SparkSession nor its xdist group, and run
beside it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from helpers import JIT_LIGHT, ROOT, spark_worker_python


def test_the_core_imports_without_pyspark_and_the_extra_says_how_to_install_it() -> None:
    blocker = (
        "import sys; sys.modules['pyspark'] = None; import subengine; "
        "assert 'pyspark' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n    import subengine.spark\nexcept ImportError as e:\n    print(e)"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocker], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'subengine[spark]'" in result.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("pyspark") is None,
    reason="PySpark is not installed: pip install -e '.[spark]'",
)
@pytest.mark.skipif(
    shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
    reason="Spark needs Java 17 or later: none found",
)
def test_the_example_runs_as_the_spark_page_shows(dsn: str, tmp_path: Path) -> None:
    # docs/spark.md's commands, as written, in a directory holding this checkout's .venv
    # and examples/, against a database of this test's own (the job starts its own Spark).
    page = (ROOT / "docs" / "spark.md").read_text()
    [commands] = [
        block
        for block in re.findall(r"```sh\n(.*?)```", page, flags=re.DOTALL)
        if "examples/spark_revenue.py" in block
    ]
    assert commands in (ROOT / "README.md").read_text()  # the README shows the same
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    # Spark's Python workers import the same PySpark from .venv, not from Spark's zip
    # (helpers.spark_worker_python): what a user's job runs, compiled once
    workers = tmp_path / "spark-python"
    workers.mkdir()
    env = dict(os.environ, SUBENGINE_DSN=dsn, PYSPARK_PYTHON=spark_worker_python(workers))
    env["JAVA_TOOL_OPTIONS"] = JIT_LIGHT
    env.pop("SUBENGINE_SPARK_TEST_DSN", None)
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "revenue" / "hourly").rglob("*.parquet"))
    with psycopg.connect(dsn) as conn:
        placed, days = conn.execute(  # type: ignore[misc]
            "SELECT count(*) FILTER (WHERE type = 'OrderPlaced'),"
            " count(*) FILTER (WHERE type = 'DailyRevenueComputed') FROM subengine.events"
        ).fetchone()
    assert placed == 500
    assert days >= 2  # the made-up orders span three days; all but the last are closed
