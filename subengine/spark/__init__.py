"""Apache Spark support: a PySpark data source named `subengine` over streams.

    import subengine.spark
    subengine.spark.register(spark)
    orders = spark.read.format("subengine").option("stream", "orders").load()

Batch and streaming reads (per-partition offsets, admission control, Trigger.AvailableNow)
and batch and streaming writes that are all or nothing and store every row once however
Spark runs and re-runs their tasks. Needs the `spark` extra: pip install
'subengine[spark]'. See docs/spark.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_INSTALL = "pip install 'subengine[spark]'"

try:
    import pyarrow  # noqa: F401
    import pyspark
except ImportError as error:
    raise ImportError(
        f"subengine.spark needs PySpark 4.2 or later and pyarrow: {_INSTALL}"
    ) from error

if tuple(int(part) for part in pyspark.__version__.split(".")[:2]) < (4, 2):
    raise ImportError(
        f"subengine.spark needs PySpark 4.2 or later (streaming admission control), "
        f"not {pyspark.__version__}: {_INSTALL}"
    )

from subengine.spark._options import DEFAULT_DSN_ENV  # noqa: E402
from subengine.spark._source import SubengineDataSource  # noqa: E402
from subengine.spark._store import RetentionGap  # noqa: E402
from subengine.streams._staged_append import StagedRowsLost  # noqa: E402

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["DEFAULT_DSN_ENV", "RetentionGap", "StagedRowsLost", "SubengineDataSource", "register"]


def register(spark: SparkSession) -> None:
    """Make `spark.read.format("subengine")` and `df.write.format("subengine")` available
    in this Spark session."""
    spark.dataSource.register(SubengineDataSource)
