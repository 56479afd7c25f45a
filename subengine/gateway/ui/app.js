// subengine's status page: follows the gateway's snapshots of the view it shows (an
// event stream, or long-polls where event streams do not get through), draws them, and
// sends an operator's actions after a confirmation. No framework: the DOM, fetch,
// EventSource, and uPlot for the lag chart.
"use strict";
(() => {
  const meta = (name) => document.querySelector(`meta[name="${name}"]`).content;
  const ROOT = meta("subengine-root");
  const CSRF = meta("subengine-csrf");
  const RETRY = meta("subengine-retry") === "true";
  const main = document.getElementById("main");
  const liveLine = document.getElementById("live");
  const notice = document.getElementById("notice");
  const dialog = document.getElementById("confirm");

  // ---- cells as the command line prints them (cli/_render.py's `cell`) ----
  function isoMillis(text) {
    const m = /^(.*T\d\d:\d\d:\d\d)(?:\.(\d+))?(.*)$/.exec(text);
    return m ? `${m[1]}.${((m[2] || "") + "000").slice(0, 3)}${m[3]}` : text;
  }
  function cell(value, kind) {
    if (value === null || value === undefined) return "-";
    if (kind === "time") return isoMillis(value);
    if (Array.isArray(value)) return value.join(", ");
    if (typeof value === "boolean") return value ? "True" : "False";
    return String(value);
  }

  // ---- building the DOM ----
  function h(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "onclick") node.addEventListener("click", value);
      else node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const stateBadge = (state, count) =>
    h("span", { class: `state state-${state}` }, count === undefined ? state : `${count} ${state}`);

  // A table of `rows`, one column per spec: {label, value(row) or field, kind, num}.
  function table(id, columns, rows, key, empty) {
    if (!rows.length) return h("p", { class: "empty", id }, empty);
    const head = h("tr", {}, columns.map((c) => h("th", { scope: "col", class: c.num ? "num" : null }, c.label)));
    const body = rows.map((row) =>
      h(
        "tr",
        { "data-key": key(row) },
        columns.map((c) => {
          const shown = c.value ? c.value(row) : cell(row[c.field], c.kind);
          const nothing = shown === "-" || shown === null;
          const classes = [c.num && "num", c.kind, c.className, nothing && "none"].filter(Boolean).join(" ");
          return h("td", { "data-label": c.label, class: classes || null }, shown);
        }),
      ),
    );
    return h("div", { class: "scroll" }, h("table", { id, class: "stack" }, h("thead", {}, head), h("tbody", {}, body)));
  }

  // Put `fresh` in the slot `id`, changing only what differs, so that focus, selection
  // and scrolling survive the updates: unchanged rows of a table stay as they are.
  function place(id, fresh) {
    const slot = document.getElementById(id);
    if (!slot) return;
    const old = slot.firstElementChild;
    if (old && old.outerHTML === fresh.outerHTML) return;
    const oldBody = old && old.querySelector("tbody");
    const newBody = fresh.querySelector && fresh.querySelector("tbody");
    const sameHead = oldBody && newBody && old.querySelector("thead").outerHTML === fresh.querySelector("thead").outerHTML;
    if (!sameHead) {
      const focused = document.activeElement && document.activeElement.dataset.focus;
      slot.replaceChildren(fresh);
      if (focused) refocus(focused);
      return;
    }
    const existing = new Map([...oldBody.children].map((row) => [row.dataset.key, row]));
    let previous = null;
    for (const row of [...newBody.children]) {
      let kept = existing.get(row.dataset.key);
      existing.delete(row.dataset.key);
      if (!kept || kept.outerHTML !== row.outerHTML) {
        if (kept) kept.replaceWith(row);
        else oldBody.insertBefore(row, previous ? previous.nextSibling : oldBody.firstChild);
        kept = row;
      } else if (kept.previousElementSibling !== previous) {
        oldBody.insertBefore(kept, previous ? previous.nextSibling : oldBody.firstChild);
      }
      previous = kept;
    }
    existing.forEach((row) => row.remove());
  }
  function refocus(key) {
    const target = document.querySelector(`[data-focus="${CSS.escape(key)}"]`);
    if (target) target.focus();
  }

  // ---- actions ----
  // The browser fires the dialog's `close` event a moment after the dialog closes, and
  // input may come first: an Enter on the button the focus went back to can open the
  // dialog again before the last close's event comes. So the event answers only the
  // confirmation that is open when it closes, and a new one settles the last at once.
  let answerConfirmation = null;
  function settleConfirmation() {
    const answer = answerConfirmation;
    answerConfirmation = null;
    if (answer) answer(dialog.returnValue === "confirm");
  }
  dialog.addEventListener("close", () => {
    if (!dialog.open) settleConfirmation();
  });
  function confirmAction(title, text, label) {
    settleConfirmation();
    document.getElementById("confirm-title").textContent = title;
    document.getElementById("confirm-text").textContent = text;
    document.getElementById("confirm-button").textContent = label;
    dialog.returnValue = "cancel";
    dialog.showModal();
    return new Promise((resolve) => {
      answerConfirmation = resolve;
    });
  }
  function say(text, ok) {
    notice.replaceChildren(h("p", { class: ok ? null : "failed" }, text));
  }
  async function send(payload) {
    let answer;
    try {
      answer = await fetch(`${ROOT}/ui/api/actions`, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", "Subengine-Csrf": CSRF },
        body: JSON.stringify(payload),
      });
    } catch {
      say("The gateway did not answer: nothing was done, or check the status before trying again.", false);
      return;
    }
    const body = await answer.json().catch(() => ({}));
    if (answer.ok) say(body.message, body.ok);
    else say((body.error && body.error.message) || `the gateway answered ${answer.status}`, false);
  }
  function actionButton(label, focusKey, payload, title, text, style) {
    return h(
      "button",
      {
        type: "button",
        class: style || "quiet",
        "data-focus": focusKey,
        "data-action": payload.action,
        onclick: async () => {
          if (await confirmAction(title, text, label)) await send(payload);
          refocus(focusKey);
        },
      },
      label,
    );
  }
  function pauseOrResume(summary) {
    const name = summary.subscription;
    if (!summary.may_act) return null;
    if (summary.is_paused || summary.stopped) {
      const restarts = summary.stopped ? ` Its ${summary.stopped} stopped partition(s) retry their failing event at once.` : "";
      return actionButton("Resume", `resume:${name}`, { action: "resume", subscription: name },
        `Resume ${name}?`, `Workers take its partitions again.${restarts}`, "quiet");
    }
    return actionButton("Pause", `pause:${name}`, { action: "pause", subscription: name },
      `Pause ${name}?`, "Workers take none of its partitions until it is resumed; batches in flight finish.", "quiet");
  }

  // ---- the views ----
  const link = (name) => h("a", { href: `#/subscriptions/${encodeURIComponent(name)}`, "data-focus": `link:${name}` }, name);
  function states(summary) {
    const shown = ["ok", "idle", "retrying", "stopped", "paused", "gap"]
      .filter((s) => summary[s])
      .map((s) => stateBadge(s, summary[s]));
    // parked keys do not stop a partition: a count beside its state
    if (summary.parked_keys) shown.push(stateBadge("parked", summary.parked_keys));
    return h("span", { class: "states" }, shown.length ? shown : "-");
  }
  const card = (label, value) => h("div", { class: "card" }, h("div", { class: "label" }, label), h("div", { class: "value" }, value));
  const skeleton = (...slots) => slots.map((slot) => (typeof slot === "string" ? h("div", { id: slot }) : slot));

  const views = {
    overview: {
      skeleton: () => skeleton(h("h1", {}, "Overview"), "cards", h("h2", {}, "Subscriptions"), "subscriptions", h("h2", {}, "Streams"), "streams"),
      draw(data) {
        const subs = data.subscriptions;
        const lag = subs.reduce((sum, s) => sum + s.lag, 0);
        const oldest = subs.map((s) => s.lag_seconds).filter((s) => s !== null).sort((a, b) => Number(b) - Number(a))[0];
        place("cards", h("div", { class: "cards" }, card("subscriptions", subs.length), card("lag", lag), card("lag s", cell(oldest)),
          card("dead letters", data.dead_letters), card("workers", data.workers), card("webhooks", data.webhooks)));
        place("subscriptions", table("subscriptions-table", [
          { label: "subscription", value: (s) => link(s.subscription) },
          { label: "stream", field: "stream" },
          { label: "partitions", field: "partitions", num: true },
          { label: "lag", field: "lag", num: true },
          { label: "lag s", field: "lag_seconds", num: true },
          { label: "states", value: states },
          { label: "workers", field: "workers", num: true },
          { label: "dead letters", field: "dead_letters", num: true },
          { label: "generation", field: "generation", num: true },
          { label: "", value: pauseOrResume, className: "actions" },
        ], subs, (s) => s.subscription, "No subscription yet."));
        place("streams", table("streams-table", [
          { label: "stream", field: "name" },
          { label: "partitions", field: "partitions", num: true },
          { label: "epoch", field: "epoch", num: true },
          { label: "retention", field: "retention" },
          { label: "appended", field: "appended", num: true },
          { label: "stored", field: "stored", num: true },
          { label: "floor", field: "floor", num: true },
          { label: "last append", field: "last_append", kind: "time" },
          { label: "events/s", field: "events_per_second", num: true },
        ], data.streams, (s) => s.name, "No stream yet."));
      },
    },
    subscription: {
      skeleton: (name) => skeleton("heading", "cards",
        h("h2", {}, "Lag over the last minutes"), h("figure", { class: "chart", id: "chart" }, h("figcaption", { id: "chart-caption", class: "muted" })),
        h("h2", {}, "Partitions"), "partitions", h("h2", {}, "Recent errors"), "errors",
        h("h2", { id: "dead-letters-title" }, "Dead letters"), "dead-letters",
        h("h2", { id: "parked-title" }, "Parked keys"), "parked"),
      draw(data) {
        if (data.missing) {
          place("heading", h("div", {}, h("h1", {}, `subscription ${data.name}`), h("p", { class: "banner" }, "There is no such subscription, or this key may not see it.")));
          return;
        }
        const s = data.summary;
        place("heading", h("div", { class: "heading" },
          h("h1", {}, `subscription ${s.subscription} `, h("span", { class: "sub" }, `on stream ${s.stream}`)),
          states(s), pauseOrResume(s)));
        place("cards", h("div", { class: "cards" }, card("lag", s.lag), card("lag s", cell(s.lag_seconds)), card("partitions", s.partitions),
          card("workers", s.workers), card("dead letters", s.dead_letters), card("parked keys", s.parked_keys),
          card("generation", s.generation)));
        drawChart(data);
        place("partitions", table("partitions-table", [
          { label: "partition", field: "partition", num: true },
          { label: "position", field: "position", num: true },
          { label: "head", field: "head", num: true },
          { label: "floor", field: "floor", num: true },
          { label: "lag", field: "lag", num: true },
          { label: "lag s", field: "lag_seconds", num: true },
          { label: "state", value: (p) => h("span", { class: "states" }, stateBadge(p.state),
            p.parked_keys ? stateBadge("parked", p.parked_keys) : null) },
          { label: "gap from", field: "gap_from", num: true },
          { label: "gap to", field: "gap_to", num: true },
          { label: "attempts", field: "attempts", num: true },
          { label: "last error", field: "last_error", className: "error" },
          { label: "worker pid", field: "worker_pid", num: true },
          { label: "worker host", field: "worker_host" },
          { label: "", className: "actions", value: (p) => p.state === "gap" && s.may_act
            ? actionButton("Skip gap", `skip:${p.partition}`, { action: "skip_gap", subscription: s.subscription, partition: p.partition },
              `Skip the gap of partition ${p.partition}?`,
              `Retention removed positions ${p.gap_from} to ${p.gap_to} before ${s.subscription} handled them. Skipping records the gap and goes on from position ${p.floor}.`, "danger")
            : null },
        ], data.partitions, (p) => String(p.partition), "No partition yet."));
        place("errors", data.errors.length
          ? h("ul", { class: "errors", id: "errors-list" }, data.errors.map((e) => h("li", {},
            h("div", { class: "when" }, `${isoMillis(e.seen_at)} · partition ${e.partition}, position ${e.position} · ${e.state}, attempt ${e.attempts}`),
            h("div", {}, e.error))))
          : h("p", { class: "empty", id: "errors-list" }, "No error since this gateway began watching."));
        document.getElementById("dead-letters-title").textContent =
          s.dead_letters > data.dead_letters.length ? `Dead letters (the newest ${data.dead_letters.length} of ${s.dead_letters})` : "Dead letters";
        const retryNote = !RETRY && (data.dead_letters.length || data.parked.length) && s.may_act
          ? h("p", { class: "muted" }, "A retry runs the subscription's handlers: start the gateway with --app to retry from here, or run subengine dead-letters retry (subengine parked retry for a key).")
          : null;
        const letters = table("dead-letters-table", [
          { label: "partition", field: "partition", num: true },
          { label: "position", field: "position", num: true },
          { label: "key", field: "key" },
          { label: "type", field: "type" },
          { label: "attempts", field: "attempts", num: true },
          { label: "retries", field: "retries", num: true },
          { label: "error", field: "error", className: "error" },
          { label: "created", field: "created_at", kind: "time" },
          { label: "", className: "actions", value: (d) => s.may_act ? h("span", {},
            RETRY ? actionButton("Retry", `retry:${d.partition}:${d.position}`, { action: "retry", subscription: s.subscription, partition: d.partition, position: d.position },
              `Retry position ${d.position} of partition ${d.partition}?`, "The subscription's handlers run the event again now, in one transaction with its resolution.", "quiet") : null,
            actionButton("Discard", `discard:${d.partition}:${d.position}`, { action: "discard", subscription: s.subscription, partition: d.partition, position: d.position },
              `Discard position ${d.position} of partition ${d.partition}?`, "The dead letter is marked discarded: its event is never handled. It stays listed by subengine dead-letters list --all.", "danger")) : null },
        ], data.dead_letters, (d) => `${d.partition}:${d.position}`, "No dead letter waits.");
        place("dead-letters", retryNote ? h("div", {}, retryNote, letters) : letters);
        document.getElementById("parked-title").textContent =
          s.parked_keys > data.parked.length ? `Parked keys (the newest ${data.parked.length} of ${s.parked_keys})` : "Parked keys";
        place("parked", table("parked-table", [
          { label: "partition", field: "partition", num: true },
          { label: "key", field: "key" },
          { label: "position", field: "position", num: true },
          { label: "events", field: "events", num: true },
          { label: "attempts", field: "attempts", num: true },
          { label: "retries", field: "retries", num: true },
          { label: "error", field: "error", className: "error" },
          { label: "created", field: "created_at", kind: "time" },
          { label: "", className: "actions", value: (k) => s.may_act ? h("span", {},
            RETRY ? actionButton("Retry", `retry-key:${k.key}`, { action: "retry_parked", subscription: s.subscription, key: k.key },
              `Retry key ${k.key}?`, `The subscription's handlers replay its ${k.events} parked event(s) now, in position order, each exactly once.`, "quiet") : null,
            actionButton("Discard", `discard-key:${k.key}`, { action: "discard_parked", subscription: s.subscription, key: k.key },
              `Discard key ${k.key}?`, `Its ${k.events} parked event(s) are never handled; the key's later events are.`, "danger")) : null },
        ], data.parked, (k) => k.key, "No key is parked."));
      },
    },
    webhooks: {
      skeleton: () => skeleton(h("h1", {}, "Webhooks"), "webhooks"),
      draw(data) {
        place("webhooks", table("webhooks-table", [
          { label: "id", field: "id", className: "nowrap" },
          { label: "state", value: (w) => stateBadge(w.paused ? "paused" : w.state) },
          { label: "callback", field: "callback", className: "url" },
          { label: "streams", field: "streams" },
          { label: "lag", field: "lag", num: true },
          { label: "attempts", field: "attempts", num: true },
          { label: "delivered", field: "delivered", num: true },
          { label: "last success", field: "last_success_at", kind: "time" },
          { label: "last attempt", field: "last_attempt_at", kind: "time" },
          { label: "last error", field: "last_error", className: "error" },
          { label: "expires", field: "expires_at", kind: "time" },
        ], data.webhooks, (w) => w.id, "No webhook subscription."));
      },
    },
    workers: {
      skeleton: () => skeleton(h("h1", {}, "Workers"), "workers"),
      draw(data) {
        place("workers", table("workers-table", [
          { label: "id", field: "id", className: "mono" },
          { label: "host", field: "host" },
          { label: "pid", field: "pid", num: true },
          { label: "subscriptions", field: "subscriptions" },
          { label: "started", field: "started_at", kind: "time" },
          { label: "heartbeat s ago", field: "seconds_since_heartbeat", num: true },
          { label: "connected", field: "connected" },
          { label: "partitions held", field: "partitions_held", num: true },
        ], data.workers, (w) => w.id, "No worker is registered."));
      },
    },
  };

  // ---- the lag chart ----
  let chart = null;
  let charted = null;
  function drawChart(data) {
    charted = data;
    const box = document.getElementById("chart");
    const { t, lag, lag_seconds: seconds } = data.history;
    const most = Math.max(0, ...lag);
    document.getElementById("chart-caption").textContent = t.length
      ? `Lag in events (and seconds) at each of the last ${t.length} snapshots: now ${lag[lag.length - 1]}, at most ${most}.`
      : "No snapshot yet.";
    if (typeof uPlot === "undefined") return;
    const series = [t, lag, seconds];
    if (chart && chart.root.isConnected) {
      chart.setData(series);
      return;
    }
    const style = getComputedStyle(document.documentElement);
    const color = (name) => style.getPropertyValue(name).trim();
    const axis = { stroke: color("--muted"), grid: { stroke: color("--line"), width: 1 }, ticks: { stroke: color("--line") } };
    chart = new uPlot({
      width: Math.max(box.clientWidth - 16, 200),
      height: 220,
      // at least the last minute, so that a few snapshots do not stretch over years
      scales: { x: { time: true, range: (u, low, high) => [Math.min(low, high - 60), high] }, s: { auto: true } },
      series: [
        {},
        { label: "lag (events)", stroke: color("--chart-lag"), width: 2, fill: color("--chart-lag") + "22" },
        { label: "lag s", stroke: color("--chart-seconds"), width: 1.5, scale: "s" },
      ],
      axes: [{ ...axis, space: 90 }, { ...axis, label: "events" }, { ...axis, side: 1, scale: "s", label: "seconds", grid: { show: false } }],
      legend: { live: false },
    }, series, box);
  }
  const resize = new ResizeObserver(() => {
    const box = document.getElementById("chart");
    if (chart && box) chart.setSize({ width: Math.max(box.clientWidth - 16, 200), height: 220 });
  });
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => {
    if (chart) {
      chart.destroy();
      chart = null;
      if (charted && document.getElementById("chart")) drawChart(charted);
    }
  });

  // ---- following the snapshots ----
  let current = null;
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  function setLive(text, down) {
    liveLine.textContent = text;
    liveLine.classList.toggle("down", Boolean(down));
  }
  function route() {
    const [first, ...rest] = location.hash.replace(/^#\/?/, "").split("/");
    if (first === "subscriptions" && rest.length) return { view: "subscription", name: decodeURIComponent(rest.join("/")) };
    if (first === "webhooks" || first === "workers") return { view: first };
    return { view: "overview" };
  }
  function query(c) {
    const params = new URLSearchParams({ view: c.view });
    if (c.name) params.set("name", c.name);
    return params.toString();
  }
  function show(c, data) {
    if (c !== current || data.version <= c.version) return;
    c.version = data.version;
    document.body.dataset.version = data.version;
    document.body.dataset.takenAt = data.taken_at || "";
    setLive(data.error || (data.taken_at ? `live · ${isoMillis(data.taken_at).slice(11, 23)}` : "waiting…"), Boolean(data.error));
    if (data.taken_at) views[data.view].draw(data);
  }
  function openStream(c) {
    const source = new EventSource(`${ROOT}/ui/api/live?${query(c)}`);
    c.source = source;
    source.addEventListener("snapshot", (event) => {
      c.failures = 0;
      c.received = true;
      show(c, JSON.parse(event.data));
    });
    source.addEventListener("close", (event) => {
      if (JSON.parse(event.data).code === "forbidden") location.reload();
    });
    source.onerror = () => {
      if (c !== current) return;
      setLive("reconnecting…", true);
      c.failures += 1;
      if (source.readyState === EventSource.CLOSED) {
        checkThenReopen(c);
      } else if (c.failures >= 3 && !c.received) {
        // event streams do not get through (a proxy): long-poll instead
        source.close();
        poll(c);
      }
    };
  }
  async function checkThenReopen(c) {
    const answer = await fetch(`${ROOT}/ui/api/snapshot?${query(c)}&wait=0`).catch(() => null);
    if (answer && answer.status === 401) return location.reload();
    await sleep(3000);
    if (c === current) openStream(c);
  }
  async function poll(c) {
    while (c === current) {
      let answer = null;
      try {
        answer = await fetch(`${ROOT}/ui/api/snapshot?${query(c)}&after=${c.version}&wait=25`);
      } catch {
        setLive("reconnecting…", true);
      }
      if (answer && answer.status === 401) return location.reload();
      if (answer && answer.status === 200) show(c, await answer.json());
      else if (!answer || answer.status !== 204) await sleep(3000);
    }
  }
  function follow() {
    if (current && current.source) current.source.close();
    const r = route();
    current = { ...r, version: 0, failures: 0, received: false, source: null };
    chart = null;
    charted = null;
    resize.disconnect();
    main.replaceChildren(...views[r.view].skeleton(r.name));
    const box = document.getElementById("chart");
    if (box) resize.observe(box);
    document.title = r.view === "subscription" ? `${r.name} · subengine status` : `${r.view} · subengine status`;
    for (const a of document.querySelectorAll("[data-nav]")) {
      if (a.dataset.nav === r.view) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
    openStream(current);
  }
  window.addEventListener("hashchange", () => {
    notice.replaceChildren();
    follow();
    main.focus();
  });
  follow();
})();
