"""helpers.spark_worker_python: Spark's workers start without Spark's zips on their path,
every other entry kept as it was."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from helpers import spark_worker_python


def test_the_worker_python_drops_sparks_zips_and_keeps_every_other_path(tmp_path: Path) -> None:
    home = "/opt/spark home/pyspark"
    kept = ["/a dir/with spaces", "/b/*", "/c/lib.zip"]
    given = [f"{home}/python/lib/pyspark.zip", kept[0], f"{home}/python/lib/py4j-0.10.9.9-src.zip"]
    given += kept[1:]
    result = subprocess.run(
        [spark_worker_python(tmp_path), "-c", "import os; print(os.environ['PYTHONPATH'])"],
        env={**os.environ, "PYTHONPATH": ":".join(given)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.rstrip("\n").split(":") == kept
