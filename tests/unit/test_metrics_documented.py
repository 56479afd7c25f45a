"""Every metric a worker exports has a row in the README's metrics table, and every row
names one it exports: the table is what operators build dashboards from."""

from __future__ import annotations

import re
from pathlib import Path

from subengine.worker._metrics import WorkerMetrics

README = Path(__file__).resolve().parents[2] / "README.md"


def _exported() -> set[str]:
    metrics = WorkerMetrics(["billing"])
    metrics.lag_read([], 0.0)  # the lag gauges exist only from the first reading
    return {
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in metrics.registry.collect()
    }


def _documented() -> set[str]:
    rows = re.findall(r"^\| `(subengine_[a-z_]+)` \|", README.read_text(), re.MULTILINE)
    return set(rows)


def test_the_readme_documents_every_worker_metric_and_no_other() -> None:
    exported, documented = _exported(), _documented()
    assert exported - documented == set(), "exported but not in the README's table"
    assert documented - exported == set(), "in the README's table but not exported"
