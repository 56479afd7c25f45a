"""A remote worker process for the tests: `python remote_worker_app.py URL SUBSCRIPTION
NAME` runs `subengine.client.RemoteWorker` until killed, recording each event's effect in
the table `effects` (as tests/apps/worker_app.py does, with the worker's NAME), on its own
autocommit connection to SUBENGINE_DSN: remote effects are at least once.
REMOTE_APP_SLEEP: seconds to sleep per event; REMOTE_APP_LEASE: lease seconds."""

import os
import sys

import psycopg

from subengine.client import Event, RemoteWorker


def main() -> None:
    url, subscription, name = sys.argv[1:4]
    pause = float(os.environ.get("REMOTE_APP_SLEEP", "0"))
    lease = float(os.environ.get("REMOTE_APP_LEASE", "30"))
    with psycopg.connect(os.environ["SUBENGINE_DSN"], autocommit=True) as conn:

        def record(event: Event) -> None:
            if pause:
                conn.execute("SELECT pg_sleep(%s)", (pause,))
            conn.execute(
                "INSERT INTO effects (event_id, key, key_version, partition, position, seq,"
                " worker) VALUES (%s, %s, %s, %s, %s, nextval('effect_order'), %s)",
                (event.id, event.key, event.key_version, event.partition, event.position, name),
            )

        with RemoteWorker(url, subscription, record, worker=name, lease_seconds=lease,
                          wait=5) as worker:  # fmt: skip
            worker.run()


if __name__ == "__main__":
    main()
