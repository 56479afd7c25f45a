"""The official Durable Streams conformance suite (`@durable-streams/server-conformance-tests`,
pinned in tests/conformance/package.json) against a real `subengine serve --durable-streams`
on the test database: one server for each whole run.

The npm packages are installed, once, into a cache folder outside the repository
(`$XDG_CACHE_HOME/subengine`, or `~/.cache/subengine`); without node and npm the test
skips, saying so. The suite runs, once against one server process and once against
`--workers 2`, through our small vitest wrapper
(tests/conformance/durable-streams.test.mjs): every case it runs by default, the forks'
included (332 at 0.3.6; the reserved subscription APIs are off by default). Every case
that fails must be in tests/conformance/known-failures.txt, with why; a case listed
there that passes is reported, so that the list only shrinks.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from ds_suite import WRAPPER, suite_folder
from helpers import GatewayProcess

KNOWN_FAILURES = WRAPPER / "known-failures.txt"
# the cases the suite runs by default, at 0.3.6: 250 core and TTL cases and 82 of forks
DEFAULT_CASES = 332
# the server's long-poll wait, short so that the cases that wait for a 204 are quick
LONG_POLL_SECONDS = "2"
RUN_SECONDS = 900

pytestmark = pytest.mark.xdist_group("durable-streams-conformance")


def known_failures() -> dict[str, str]:
    """The cases that may fail, each with why: `case name | why` per line."""
    known = {}
    for line in KNOWN_FAILURES.read_text("utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, separator, why = line.partition(" | ")
        assert separator and why.strip(), f"known-failures.txt: say why {name!r} fails"
        known[name.strip()] = why.strip()
    return known


def case_results(report: Path) -> dict[str, str]:
    """Each case's full name (describe blocks and title, joined by ' > ') and status."""
    results = {}
    for file in json.loads(report.read_text("utf-8"))["testResults"]:
        for case in file["assertionResults"]:
            name = " > ".join([*case["ancestorTitles"], case["title"]])
            results[name] = case["status"]
    return results


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_conformance_suite_passes(
    cli_env: dict[str, str], tmp_path: Path, workers: str
) -> None:
    # with --workers 2, requests of one case land on either process: what one process
    # wrote (producer state, closed state, a long-poll's wake-up) must reach the other
    folder = suite_folder()
    known = known_failures()
    report = tmp_path / "conformance.json"
    args = (
        "--durable-streams",
        "--durable-streams-long-poll",
        LONG_POLL_SECONDS,
        "--workers",
        workers,
    )
    with GatewayProcess(cli_env, *args, tmp=tmp_path) as server:
        run = subprocess.run(
            [
                "node",
                "node_modules/vitest/vitest.mjs",
                "run",
                "--config",
                "vitest.config.mjs",
                "--reporter=json",
                f"--outputFile={report}",
            ],
            cwd=folder,
            env={**os.environ, "CONFORMANCE_TEST_URL": f"{server.url}/ds", "NO_COLOR": "1"},
            capture_output=True,
            text=True,
            timeout=RUN_SECONDS,
        )
    assert report.exists(), f"the suite wrote no report:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    results = case_results(report)
    ran = {name: status for name, status in results.items() if status in ("passed", "failed")}
    passed = sorted(name for name, status in ran.items() if status == "passed")
    failed = sorted(name for name, status in ran.items() if status == "failed")
    unexpected = [name for name in failed if name not in known]
    fixed = [name for name in known if ran.get(name) == "passed"]
    print(f"durable streams conformance: {len(passed)} passed, {len(failed)} failed")
    for name in fixed:
        print(f"now passes, take it off known-failures.txt: {name}")
    assert ran, f"no case ran:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    assert len(ran) == DEFAULT_CASES, f"{len(ran)} cases ran, not {DEFAULT_CASES}"
    assert not unexpected, "cases failed that known-failures.txt does not name:\n" + "\n".join(
        unexpected
    )
