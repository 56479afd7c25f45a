"""A callback that a gateway process refuses at the PUT (docs/webhooks.md, "Callbacks and
internal networks"): the refusal is one line that says what is refused and that
`--callback-allow` must be given to the process that answers the PUT, `--no-deliver`
ones too."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import GatewayProcess

from subengine.client import GatewayError, Subscriber


def test_a_callback_refused_at_the_put_names_the_option_that_allows_it(
    orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    # a process that does not deliver still checks the callback when it answers the PUT
    with GatewayProcess(cli_env, "--no-deliver", tmp=tmp_path) as gateway:
        subscriber = Subscriber(gateway.url, "http://127.0.0.1:9/hook", ["orders"])
        try:
            with pytest.raises(GatewayError) as refused:
                subscriber.start()
        finally:
            subscriber.close()
        message = str(refused.value)
        assert "\n" not in message and refused.value.code == "callback_refused"
        assert "127.0.0.1" in message and "loopback" in message
        assert "--callback-allow 127.0.0.1/32" in message
        assert "--no-deliver" in message and "answers the PUT" in message
    assert "Traceback" not in gateway.output()
