// The dashboard's data loop: every second, fetch the sidecar's JSON endpoints and redraw.
// Everything is inserted as text (textContent / dataset), never as HTML: instance ids and
// addresses come from registrations, i.e. from whoever can reach the control plane.
"use strict";

(function () {
  const TOKEN_KEY = "cacheroute.dashboard.token";  // sessionStorage only: gone with the tab
  const REFRESH_MS = 1000;
  const TIMEOUT_MS = 4000;
  const $ = (id) => document.getElementById(id);
  const chart = new window.InflightChart($("chart"));
  let timer = null, busy = false, updates = 0;

  class Unauthorized extends Error {}

  // --- DOM helpers: text only -------------------------------------------------------------
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "data") Object.assign(node.dataset, value);
      else if (key === "className") node.className = value;
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const setText = (id, text) => { $(id).textContent = text; };
  const known = (v) => v !== null && v !== undefined;
  const fmtInt = (v) => known(v) ? String(Math.round(v)) : "—";
  const fmtNum = (v, digits) => known(v) ? Number(v).toFixed(digits) : "—";
  function fmtMs(v) {
    if (!known(v)) return "—";
    return v >= 1000 ? `${(v / 1000).toFixed(1)} s` : `${Math.round(v)} ms`;
  }
  function fmtAgo(ms) {
    if (!known(ms)) return "—";
    const s = Math.max(0, ms) / 1000;
    return s < 10 ? `${s.toFixed(1)} s ago` : `${Math.round(s)} s ago`;
  }
  // A numeric cell: the raw value in data-value ("" = unknown) for tests and tooling.
  function numCell(field, value, text, extraClass) {
    const cls = ["num", known(value) ? "" : "unknown", extraClass || ""].join(" ").trim();
    return el("td", { className: cls, data: { field, value: known(value) ? String(value) : "" } }, text);
  }

  // --- fetching ----------------------------------------------------------------------------
  async function fetchJSON(path) {
    const headers = { Accept: "application/json" };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    const abort = new AbortController();
    const timeout = setTimeout(() => abort.abort(), TIMEOUT_MS);
    try {
      const response = await fetch(path, { headers, signal: abort.signal, cache: "no-store", credentials: "omit" });
      if (response.status === 401) throw new Unauthorized(path);
      if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
      return await response.json();
    } catch (err) {
      if (err.name === "AbortError") throw new Error(`${path}: no answer within ${TIMEOUT_MS / 1000} s`);
      throw err;
    } finally {
      clearTimeout(timeout);
    }
  }

  async function tick() {
    busy = true;
    const started = performance.now();
    try {
      const [loads, status, workers] = await Promise.all([
        fetchJSON("/debug/instance_loads"), fetchJSON("/debug/status"), fetchJSON("/debug/workers")]);
      render(loads, status, workers);
      showAuth(false);
      setConn("live", `live · updated ${new Date().toLocaleTimeString()}`);
    } catch (err) {
      if (err instanceof Unauthorized) {
        showAuth(true);
        setConn("unauthorized", "token required");
      } else {
        setConn("error", `error: ${err.message || err}`);
      }
    } finally {
      busy = false;
      schedule(Math.max(100, REFRESH_MS - (performance.now() - started)));
    }
  }

  function schedule(delay) {
    clearTimeout(timer);
    timer = setTimeout(() => { if (!busy) tick(); }, delay);
  }

  function setConn(state, text) {
    const pill = $("conn");
    pill.dataset.state = state;
    pill.textContent = text;
    document.body.dataset.state = state;
  }

  // --- token ---------------------------------------------------------------------------------
  function showAuth(needed) {
    $("auth").hidden = !needed;
    if (needed) {
      setText("auth-message", sessionStorage.getItem(TOKEN_KEY)
        ? "That token was refused; enter the current one." : "Enter the token to see the data.");
    }
  }

  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = $("token-input");
    const token = input.value.trim();
    input.value = "";
    if (!token) return;
    sessionStorage.setItem(TOKEN_KEY, token);
    setText("auth-message", "checking…");
    schedule(0);
  });

  // --- rendering -------------------------------------------------------------------------------
  function liveness(row, generatedAt, ttlS) {
    // Out of the candidate set: because it said so (or its probe failed), or past the TTL.
    if (!row.is_alive) return row.health === "unhealthy" ? "unhealthy" : "dead";
    // Still in the candidate set, but heartbeats are being missed: it expires at the TTL.
    return generatedAt - row.last_seen_ms > ttlS * 500 ? "stale" : "alive";
  }

  function render(loads, status, workers) {
    const now = Date.now();
    chart.add(now, new Map(loads.instances.map((r) => [r.instance_id, r.inflight])));
    renderHeader(loads, status);
    renderCards(loads, status, workers.workers);
    renderInstances(loads);
    renderWorkers(workers.workers);
    renderChannel(status, workers.workers);
    chart.draw(now);
    renderLegend();
    updates += 1;
    document.body.dataset.updates = String(updates);
  }

  function renderHeader(loads, status) {
    setText("sidecar-pid", fmtInt(status.sidecar.pid));
    setText("sidecar-epoch", fmtInt(status.sidecar.epoch));
    $("sidecar-epoch").dataset.value = String(status.sidecar.epoch);
    setText("strategy", loads.strategy);
    setText("load-view", loads.load_view);
  }

  function renderCards(loads, status, workers) {
    const inflight = loads.instances.reduce((sum, r) => sum + (r.inflight || 0), 0);
    setText("sum-instances", `${status.alive_instances} / ${status.total_instances}`);
    setText("sum-inflight", String(inflight));
    setText("sum-workers", `${workers.filter((w) => w.alive).length} / ${workers.length}`);
    setText("snapshot-age", fmtMs(loads.snapshot_age_ms));
    $("snapshot-age").dataset.value = known(loads.snapshot_age_ms) ? String(loads.snapshot_age_ms) : "";
    setText("snapshot-state", `pressure: ${loads.metric_source.predicted_pressure}`);
    const channel = status.event_channel;
    setText("ev-consumed", fmtInt(channel.events_consumed));
    setText("ev-dropped", fmtInt(channel.events_dropped_by_workers));
    setText("ev-lag", String(workers.reduce((sum, w) => sum + w.events_pending, 0)));
    const full = workers.filter((w) => w.ring_full).length;
    setText("ev-spill", full ? `${full} ring(s) full: workers spilling` : "none spilling");
  }

  function renderInstances(loads) {
    const body = $("instances").tBodies[0];
    if (!loads.instances.length) {
      body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 15 }, "no instances registered")));
      return;
    }
    body.replaceChildren(...loads.instances.map((r) => instanceRow(r, loads)));
  }

  function instanceRow(r, loads) {
    const state = liveness(r, loads.generated_at, loads.ttl_s);
    const swatch = el("span", { className: "swatch" });
    swatch.style.background = chart.colorOf(r.instance_id);
    const score = r.least_load_score || {};
    const scoreCell = numCell("least_load_score", known(score.total) ? score.total : null, fmtNum(score.total, 2));
    scoreCell.title = Object.entries(score.weighted_components || {})
      .map(([k, v]) => `${k}: ${v}`).join("\n");
    const heard = known(r.last_seen_ms) ? loads.generated_at - r.last_seen_ms : null;
    return el("tr", { data: { instanceId: r.instance_id, liveness: state, inflight: fmtInt(r.inflight) } },
      el("td", { data: { field: "instance_id" } },
        el("div", { className: "id" }, swatch, r.instance_id),
        el("div", { className: "addr" }, `${r.address} · slot ${r.slot} gen ${r.slot_generation}`)),
      el("td", { data: { field: "liveness" } }, el("span", { className: "badge", data: { state } }, state)),
      numCell("inflight", r.inflight, fmtInt(r.inflight), "strong"),
      numCell("active_prepare", r.active_prepare, fmtInt(r.active_prepare)),
      numCell("active_ready", r.active_ready, fmtInt(r.active_ready)),
      numCell("prepare_queue_depth", r.prepare_queue_depth, fmtInt(r.prepare_queue_depth)),
      numCell("ready_queue_depth", r.ready_queue_depth, fmtInt(r.ready_queue_depth)),
      numCell("pending_prefill_count", r.pending_prefill_count, fmtInt(r.pending_prefill_count)),
      numCell("active_decode_count", r.active_decode_count, fmtInt(r.active_decode_count)),
      numCell("next_slot_ready_in_ms", r.next_slot_ready_in_ms, fmtMs(r.next_slot_ready_in_ms)),
      numCell("prefill_free_in_ms", r.prefill_free_in_ms, fmtMs(r.prefill_free_in_ms)),
      numCell("predicted_total_backlog_ms", r.predicted_total_backlog_ms, fmtMs(r.predicted_total_backlog_ms)),
      numCell("qps_1m", r.qps_1m, fmtNum(r.qps_1m, 2)),
      numCell("heartbeat_age_ms", heard, fmtAgo(heard)),
      scoreCell);
  }

  function renderWorkers(workers) {
    const body = $("workers").tBodies[0];
    if (!workers.length) {
      body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 8 }, "no worker rows claimed")));
      return;
    }
    body.replaceChildren(...workers.map((w) => {
      const state = w.alive ? "alive" : "dead";
      const held = el("td", { className: "num strong", data: { field: "inflight_held", value: String(w.inflight_held) } },
        String(w.inflight_held));
      held.title = Object.entries(w.inflight_by_instance).map(([id, n]) => `${id}: ${n}`).join("\n");
      return el("tr", { data: { pid: String(w.pid), workerIndex: String(w.worker_index), alive: String(w.alive),
                                inflightHeld: String(w.inflight_held) } },
        numCell("worker_index", w.worker_index, String(w.worker_index)),
        numCell("pid", w.pid, String(w.pid)),
        numCell("row", w.row, String(w.row)),
        el("td", {}, el("span", { className: "badge", data: { state } }, state)),
        numCell("heartbeat_age_ms", w.heartbeat_age_ms, fmtMs(w.heartbeat_age_ms)),
        held,
        numCell("events_pending", w.events_pending, `${w.events_pending} / ${w.ring_capacity}`),
        numCell("events_dropped", w.events_dropped, String(w.events_dropped)));
    }));
  }

  function renderChannel(status, workers) {
    const c = status.event_channel, seg = status.segment, reaper = status.reaper;
    const items = [
      ["sidecar epoch", c.epoch, "epoch"],
      ["events read", c.events_consumed, "events_consumed"],
      ["dropped by workers", c.events_dropped_by_workers, "events_dropped"],
      ["ring backlog (lag)", workers.reduce((s, w) => s + w.events_pending, 0), "events_pending"],
      ["rings full (spilling)", workers.filter((w) => w.ring_full).length, "rings_full"],
      ["from an older epoch", c.events_from_previous_epoch, "events_from_previous_epoch"],
      ["pending reservations", c.pending_reservations, "pending_reservations"],
      ["decoding", c.decoding, "decoding"],
      ["expired reservations", c.expired_reservations, "expired_reservations"],
      ["snapshots published", c.snapshots_published, "snapshots_published"],
      ["sidecar heartbeat", fmtAgo(seg.sidecar_heartbeat_age_ms), "sidecar_heartbeat_age_ms"],
      ["workers reaped", reaper.reaped, "reaped"],
      ["inflight subtracted", reaper.subtracted, "subtracted"],
      ["reconcile corrections", reaper.corrections, "corrections"],
      ["segment", seg.name, "segment"],
      ["scheduler link", schedulerLink(status.scheduler), "scheduler"],
    ];
    $("channel").replaceChildren(...items.flatMap(([label, value, key]) => [
      el("dt", {}, label), el("dd", { data: { field: key } }, known(value) ? String(value) : "—")]));
  }

  // /debug/status → scheduler (sidecar/scheduler_link.py); absent on an older sidecar.
  function schedulerLink(link) {
    if (!link) return null;
    if (!link.enabled) return "off";
    const failing = link.consecutive_failures ? ` · ${link.consecutive_failures} failing` : "";
    return `${link.registered ? "registered" : "not registered"}${failing}`;
  }

  function renderLegend() {
    $("legend").replaceChildren(...[...chart.series.keys()].map((id) => {
      const swatch = el("span", { className: "swatch" });
      swatch.style.background = chart.colorOf(id);
      return el("li", { data: { instanceId: id } }, swatch, id);
    }));
  }

  // Redraw on resize so the canvas keeps its pixel ratio; data comes with the next tick.
  window.addEventListener("resize", () => chart.draw(Date.now()));
  schedule(0);
})();
