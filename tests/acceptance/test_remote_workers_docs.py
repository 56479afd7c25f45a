"""docs/remote-workers.md runs: its setup commands, then each curl example against a real
gateway (a fresh lease for each lease request), answered with the documented fields."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import web
from helpers import ROOT, GatewayProcess, subengine_command

import subengine
from subengine import NewEvent

DOC = (ROOT / "docs" / "remote-workers.md").read_text()

pytestmark = pytest.mark.xdist_group("remote-workers")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC, flags=re.DOTALL)


def _examples() -> list[tuple[str, dict[str, Any]]]:
    """Each curl command with the JSON answer documented after it."""
    pairs = re.findall(r"```sh\n(curl .*?)```\s*```json\n(.*?)```", DOC, flags=re.DOTALL)
    return [(command, json.loads(answer)) for command, answer in pairs]


def _run(command: str, env: dict[str, str]) -> Any:
    done = subprocess.run(
        ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout)


def test_the_setup_and_every_curl_example_run(
    gateway: GatewayProcess, engine: subengine.Engine, cli_env: dict[str, str]
) -> None:
    engine.create_stream("orders", partitions=4)
    [setup] = [block for block in _blocks("sh") if block.startswith("subengine subscription")]
    bin_dir = str(Path(subengine_command()).parent)
    cli_env = {**cli_env, "PATH": f"{bin_dir}:{cli_env.get('PATH', '')}"}
    subprocess.run(["bash", "-ec", setup], env=cli_env, check=True, capture_output=True)
    assert engine.remote_subscription("orders-mailer").on_error == "dead_letter"
    _, token = engine.create_api_key(["consume"], ["orders"])
    events = [NewEvent(f"order-{n}", "OrderPaid", {"amount": n}) for n in range(40)]
    engine.append("orders", events)  # every partition has some: each example's claim has one
    env = {**cli_env, "GATEWAY": gateway.url, "TOKEN": token}
    examples = _examples()
    assert len(examples) == 5
    for command, documented in examples:
        if "$LEASE" in command:
            claimed = web.post(
                f"{gateway.url}/v1/subscriptions/orders-mailer/claim",
                headers={"Authorization": f"Bearer {token}"},
                json={"max_events": 1},
            ).json()
            env["LEASE"] = claimed["lease"]
            # the documented position is the example's: the lease's own here
            command = command.replace('"position": 42', f'"position": {claimed["through"]}')
        answer = _run(command, env)
        assert set(answer) == set(documented), (command, answer)
        if "events" in documented:
            assert set(answer["events"][0]) == set(documented["events"][0])
