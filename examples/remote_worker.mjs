// A remote worker of subengine in Node (20 or later; no packages): it claims leases on a
// subscription's partitions through the gateway, handles each event in order, extends
// the lease while it works, acks the batch, and nacks the event whose handling failed.
// Effects are at least once: `handle` skips an event whose id it has seen (a real worker
// keeps the ids in the store its effects go to, in the same transaction).
//
//   SUBENGINE_GATEWAY=http://127.0.0.1:8800 node remote_worker.mjs orders-mailer
//
// SUBENGINE_API_KEY: a token with the `consume` scope on the subscription's stream.
// EXIT_WHEN_IDLE=1: stop once a claim waited in vain (for scripts and tests).

const gateway = process.env.SUBENGINE_GATEWAY ?? "http://127.0.0.1:8800";
const subscription = process.argv[2] ?? "orders-mailer";
const leaseSeconds = 30;
const exitWhenIdle = process.env.EXIT_WHEN_IDLE === "1";
const headers = { "Content-Type": "application/json" };
if (process.env.SUBENGINE_API_KEY) {
  headers.Authorization = `Bearer ${process.env.SUBENGINE_API_KEY}`;
}

async function call(path, body = {}) {
  const url = `${gateway}/v1/subscriptions/${encodeURIComponent(subscription)}${path}`;
  const response = await fetch(url, { method: "POST", headers, body: JSON.stringify(body) });
  if (response.status === 204) return null; // no partition free before `wait` ended
  const answer = await response.json();
  if (!response.ok) {
    const error = new Error(`${response.status} ${answer.error.code}: ${answer.error.message}`);
    error.status = response.status;
    throw error;
  }
  return answer;
}

const seen = new Set();

async function handle(event) {
  if (seen.has(event.id)) return; // handled before a lost lease: do not do it twice
  // ... the effect goes here ...
  console.log(JSON.stringify({ id: event.id, partition: event.partition, position: event.position }));
  seen.add(event.id);
}

for (;;) {
  const lease = await call("/claim", { worker: `node-${process.pid}`, lease_seconds: leaseSeconds, wait: exitWhenIdle ? 2 : 20 });
  if (lease === null) {
    if (exitWhenIdle) break;
    continue;
  }
  const leasePath = `/leases/${lease.lease}`;
  // Until when the lease is surely held: nine tenths of its length after the claim's
  // answer, or after an answered heartbeat was sent. Past it, or once a heartbeat hears
  // 409/404, no further event is started: another worker may have the partition now.
  let sureUntil = Date.now() + leaseSeconds * 900;
  let lost = false;
  const heartbeat = setInterval(() => {
    const sent = Date.now();
    call(`${leasePath}/extend`, { lease_seconds: leaseSeconds })
      .then(() => { sureUntil = Math.max(sureUntil, sent + leaseSeconds * 900); })
      .catch((error) => {
        if (error.status === 409 || error.status === 404) lost = true;
        console.error(`heartbeat: ${error.message}`);
      });
  }, (leaseSeconds * 1000) / 3);
  const held = () => !lost && Date.now() < sureUntil;
  try {
    let stopped = false;
    // a lease carries events, or the tombstone of a gap retention left, to ack past
    for (const event of lease.events) {
      if (!held()) {
        console.error(`lease ${lease.lease} lost; stopping before position ${event.position}`);
        stopped = true;
        break;
      }
      try {
        await handle(event);
      } catch (error) {
        // the events before this one are acknowledged with the nack
        await call(`${leasePath}/nack`, { position: event.position, error: String(error) });
        stopped = true;
        break;
      }
    }
    if (!stopped && !lost) await call(`${leasePath}/ack`);
  } catch (error) {
    if (error.status !== 409 && error.status !== 404) throw error; // the lease was lost
    console.error(error.message);
  } finally {
    clearInterval(heartbeat);
  }
}
