// The dashboard's data loop: poll the sidecar's /debug/dashboard (one read-only document) and
// redraw every panel from it. Everything is inserted as text (textContent / dataset), never as
// HTML: instance ids, addresses and KDN keys come from registrations and reports, i.e. from
// whoever can reach the control plane.
"use strict";

(function () {
  const TOKEN_KEY = "cacheroute.dashboard.token";   // sessionStorage only: gone with the tab
  const PREFS_KEY = "cacheroute.dashboard.prefs";   // localStorage, written only when changed
  const DATA_PATH = "/debug/dashboard";
  const TIMEOUT_MS = 4000;
  const $ = (id) => document.getElementById(id);
  const { Palette, History, TrendChart } = window.Trends;

  // Until the user picks a theme, the system's preference decides.
  const systemTheme = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
  const prefs = Object.assign({ intervalMs: 1000, historyS: 300, theme: systemTheme, sort: {} }, loadPrefs());
  const palette = new Palette();
  const history = { inflight: new History(), backlog: new History(), queue: new History(), pool: new History(), cpu: new History(),
                    memory: new History(), gpu: new History(), network: new History() };
  const ms = (v) => (v >= 1000 ? `${+(v / 1000).toFixed(2)}s` : `${+v.toFixed(2)}ms`);
  const charts = {
    inflight: new TrendChart($("chart"), { format: (v) => String(v) }),
    backlog: new TrendChart($("chart-backlog"), { format: ms }),
    queue: new TrendChart($("chart-queue"), { format: (v) => String(v) }),
    pool: new TrendChart($("chart-pool"), { format: (v) => String(v) }),
    cpu: new TrendChart($("chart-cpu"), { format: (v) => `${v}%`, yMax: 100 }),
    memory: new TrendChart($("chart-memory"), { format: (v) => `${v}%`, yMax: 100 }),
    gpu: new TrendChart($("chart-gpu"), { format: (v) => `${v}%`, yMax: 100 }),
    network: new TrendChart($("chart-network"), { format: (v) => String(v) }),
  };
  const POOL_COLORS = { alive: "#1d9a6c", stale: "#d49a00", out: "#d94535" };
  let timer = null, busy = false, paused = false, updates = 0, requests = 0, lastDoc = null;
  // Refresh clicked while a fetch is out: one more right after it, so what is shown is newer
  // than the click (paused or not).
  let refreshAfter = false;

  class Unauthorized extends Error {}

  // --- preferences ---------------------------------------------------------------------------
  function loadPrefs() {
    try { return JSON.parse(localStorage.getItem(PREFS_KEY) || "{}") || {}; } catch (err) { return {}; }
  }
  function savePrefs() {
    try { localStorage.setItem(PREFS_KEY, JSON.stringify(prefs)); } catch (err) { /* private mode */ }
  }

  // --- DOM helpers: text only -------------------------------------------------------------
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "data") Object.assign(node.dataset, value);
      else if (key === "className") node.className = value;
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const setText = (id, text) => { $(id).textContent = text; };
  const setValue = (id, value, text) => {
    $(id).textContent = text;
    $(id).dataset.value = known(value) ? String(value) : "";
  };
  const known = (v) => v !== null && v !== undefined;
  const fmtInt = (v) => known(v) ? String(Math.round(v)) : "—";
  const fmtNum = (v, digits) => known(v) ? Number(v).toFixed(digits) : "—";
  const fmtPct = (v) => known(v) ? `${Number(v).toFixed(v < 10 ? 1 : 0)}%` : "—";
  const fmtMbps = (v) => known(v) ? `${Number(v).toFixed(v < 10 ? 2 : 0)} Mbit/s` : "—";
  function fmtMs(v) {
    if (!known(v)) return "—";
    if (v >= 1000) return `${(v / 1000).toFixed(1)} s`;
    return v < 10 && !Number.isInteger(v) ? `${v.toFixed(1)} ms` : `${Math.round(v)} ms`;
  }
  function fmtAgo(v) {
    if (!known(v)) return "—";
    const s = Math.max(0, v) / 1000;
    return s < 10 ? `${s.toFixed(1)} s ago` : `${Math.round(s)} s ago`;
  }
  function fmtMb(v) {
    if (!known(v)) return "—";
    return v >= 1024 ? `${(v / 1024).toFixed(1)} GB` : `${Math.round(v)} MB`;
  }
  // A numeric cell: the raw value in data-value ("" = unknown) for tests and tooling.
  function numCell(field, value, text, extraClass) {
    const cls = ["num", known(value) ? "" : "unknown", extraClass || ""].join(" ").trim();
    return el("td", { className: cls, data: { field, value: known(value) ? String(value) : "" } }, text);
  }
  function swatch(color, dashed) {
    const node = el("span", { className: dashed ? "swatch dashed" : "swatch" });
    node.style.background = color;
    return node;
  }
  function badge(state) { return el("span", { className: "badge", data: { state } }, state); }

  // --- fetching ----------------------------------------------------------------------------
  async function fetchJSON(path) {
    const headers = { Accept: "application/json" };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    const abort = new AbortController();
    const timeout = setTimeout(() => abort.abort(), TIMEOUT_MS);
    requests += 1;
    document.body.dataset.requests = String(requests);
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
      const doc = await fetchJSON(DATA_PATH);
      lastDoc = doc;
      record(doc);
      render(doc);
      showAuth(false);
      setConn("live", `live · ${new Date().toLocaleTimeString()}`);
    } catch (err) {
      if (err instanceof Unauthorized) {
        showAuth(true);
        setConn("unauthorized", "token required");
      } else {
        setConn("error", `error: ${err.message || err}`);
      }
    } finally {
      busy = false;
      if (refreshAfter) {
        refreshAfter = false;
        tick();
      } else {
        schedule(Math.max(100, prefs.intervalMs - (performance.now() - started)));
      }
    }
  }

  function schedule(delay) {
    clearTimeout(timer);
    timer = null;
    if (paused) return;
    timer = setTimeout(() => { if (!busy) tick(); }, delay);
  }

  function setConn(state, text) {
    const pill = $("conn");
    pill.dataset.state = state;
    pill.textContent = paused ? `paused · ${text}` : text;
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

  // --- controls ------------------------------------------------------------------------------
  function applyTheme() {
    document.documentElement.dataset.theme = prefs.theme;
    $("btn-theme").textContent = prefs.theme === "dark" ? "Light theme" : "Dark theme";
  }
  function applyPaused() {
    document.body.dataset.polling = paused ? "paused" : "on";
    $("btn-pause").textContent = paused ? "Resume" : "Pause";
    $("btn-pause").setAttribute("aria-pressed", String(paused));
  }

  $("btn-theme").addEventListener("click", () => {
    prefs.theme = prefs.theme === "dark" ? "light" : "dark";
    savePrefs();
    applyTheme();
    if (lastDoc) drawCharts();
  });
  $("btn-pause").addEventListener("click", () => {
    paused = !paused;
    applyPaused();
    if (paused) { clearTimeout(timer); timer = null; setConn(document.body.dataset.state, "polling stopped"); }
    else schedule(0);
  });
  $("btn-refresh").addEventListener("click", () => { if (busy) refreshAfter = true; else tick(); });
  $("interval").value = String(prefs.intervalMs);
  $("interval").addEventListener("change", (event) => {
    prefs.intervalMs = Number(event.target.value);
    savePrefs();
    schedule(0);
  });
  $("history").value = String(prefs.historyS);
  $("history").addEventListener("change", (event) => {
    prefs.historyS = Number(event.target.value);
    savePrefs();
    if (lastDoc) drawCharts();
  });
  for (const id of ["search", "filter-state"]) {
    $(id).addEventListener("input", () => { if (lastDoc) renderInstanceViews(lastDoc); });
  }
  $("raw-source").addEventListener("change", () => { if (lastDoc) renderRaw(lastDoc, true); });
  $("raw-copy").addEventListener("click", () => copy(rawPart(lastDoc, $("raw-source").value), $("raw-source").value));
  $("raw-copy-all").addEventListener("click", () => copy(lastDoc, "all"));

  // Sorting: a click on a header sorts by it, a second click reverses; kept in the prefs.
  for (const table of document.querySelectorAll("table.sortable")) {
    table.tHead.addEventListener("click", (event) => {
      const th = event.target.closest("th[data-sort]");
      if (!th) return;
      const current = prefs.sort[table.id];
      const dir = current && current.key === th.dataset.sort && current.dir === "asc" ? "desc" : "asc";
      prefs.sort[table.id] = { key: th.dataset.sort, dir };
      savePrefs();
      if (lastDoc) render(lastDoc);
    });
  }

  function sorted(tableId, rows, valueOf) {
    const order = prefs.sort[tableId];
    for (const th of $(tableId).querySelectorAll("th[data-sort]")) {
      th.setAttribute("aria-sort", order && order.key === th.dataset.sort
        ? (order.dir === "asc" ? "ascending" : "descending") : "none");
    }
    if (!order) return rows;
    const sign = order.dir === "asc" ? 1 : -1;
    return [...rows].sort((a, b) => {
      const x = valueOf(a, order.key), y = valueOf(b, order.key);
      if (!known(x) || !known(y)) return known(x) ? -1 : known(y) ? 1 : 0;  // unknown last, either way
      if (typeof x === "number" && typeof y === "number") return sign * (x - y);
      return sign * String(x).localeCompare(String(y));
    });
  }

  async function copy(value, source) {
    const text = JSON.stringify(value, null, 2);
    let done = false;
    try {
      if (navigator.clipboard && window.isSecureContext) {
        await navigator.clipboard.writeText(text);
        done = true;
      }
    } catch (err) { /* not allowed here: fall back to a selection */ }
    if (!done) {
      const area = el("textarea", { readonly: "", "aria-hidden": "true", className: "offscreen" });
      area.value = text;
      document.body.append(area);
      area.select();
      try { done = document.execCommand("copy"); } catch (err) { done = false; }
      area.remove();
    }
    const note = $("raw-copied");
    note.dataset.copied = done ? source : "";
    note.textContent = done ? `copied ${source} (${text.length} characters)` : "copy refused by the browser: select the text";
  }

  // --- the model ------------------------------------------------------------------------------
  function liveness(row, generatedAt, ttlS) {
    // Out of the candidate set: because it said so (or its probe failed), or past the TTL.
    if (!row.is_alive) return row.health === "unhealthy" ? "unhealthy" : "dead";
    // Still in the candidate set, but heartbeats are being missed: it expires at the TTL.
    return generatedAt - row.last_seen_ms > ttlS * 500 ? "stale" : "alive";
  }

  /** One object per instance: its /debug/instance_loads row, its resource, what the page derives. */
  function instanceModels(doc) {
    const resources = new Map(doc.resources.map((r) => [r.instance_id, r.resource]));
    const loads = doc.loads;
    return loads.instances.map((r) => {
      const res = resources.get(r.instance_id) || null;
      const memPct = res && known(res.memory_used_mb) && res.memory_total_mb
        ? (100 * res.memory_used_mb) / res.memory_total_mb : null;
      return {
        ...r, resource: res, liveness: liveness(r, loads.generated_at, loads.ttl_s),
        heartbeat_age_ms: known(r.last_seen_ms) ? loads.generated_at - r.last_seen_ms : null,
        cpu_util: res ? res.cpu_util : null, memory_pct: memPct, gpu_util_avg: res ? res.gpu_util_avg : null,
        score: r.least_load_score || {},
        least_load_score: r.least_load_score && known(r.least_load_score.total) ? r.least_load_score.total : null,
      };
    });
  }

  function visible(models) {
    const needle = $("search").value.trim().toLowerCase();
    const state = $("filter-state").value;
    return models.filter((m) => {
      if (needle && !`${m.instance_id} ${m.address}`.toLowerCase().includes(needle)) return false;
      if (state === "out") return m.liveness === "dead" || m.liveness === "unhealthy";
      return state === "all" || m.liveness === state;
    });
  }

  function record(doc) {
    const t = doc.generated_at_ms / 1000;
    const models = instanceModels(doc);
    const per = (f) => new Map(models.map((m) => [m.instance_id, f(m)]));
    history.inflight.add(t, per((m) => m.inflight));
    history.backlog.add(t, per((m) => m.predicted_total_backlog_ms));
    history.queue.add(t, per((m) => known(m.prepare_queue_depth) || known(m.ready_queue_depth)
      ? (m.prepare_queue_depth || 0) + (m.ready_queue_depth || 0) : null));
    history.cpu.add(t, per((m) => m.cpu_util));
    history.memory.add(t, per((m) => m.memory_pct));
    history.gpu.add(t, per((m) => m.gpu_util_avg));
    const net = new Map();
    for (const m of models) {
      net.set(`${m.instance_id}\u0000rx`, m.resource ? m.resource.network_rx_mbps : null);
      net.set(`${m.instance_id}\u0000tx`, m.resource ? m.resource.network_tx_mbps : null);
    }
    history.network.add(t, net);
    const count = (states) => models.filter((m) => states.includes(m.liveness)).length;
    history.pool.add(t, new Map([["alive", count(["alive"])], ["stale", count(["stale"])],
                                 ["out", count(["dead", "unhealthy"])]]));
  }

  // --- rendering -------------------------------------------------------------------------------
  function render(doc) {
    renderHeader(doc);
    renderCards(doc);
    renderInstanceViews(doc);
    renderWorkers(doc.workers);
    renderChannel(doc.status, doc.workers);
    renderScheduler(doc.status.scheduler, doc.pool_resource);
    renderTopology(doc.topology);
    renderAffinity(doc.affinity);
    renderRaw(doc, false);
    drawCharts();
    updates += 1;
    document.body.dataset.updates = String(updates);
  }

  function renderHeader(doc) {
    const status = doc.status;
    setText("sidecar-pid", fmtInt(status.sidecar.pid));
    setValue("sidecar-epoch", status.sidecar.epoch, fmtInt(status.sidecar.epoch));
    setText("strategy", doc.loads.strategy);
    setText("load-view", doc.loads.load_view);
  }

  function renderCards(doc) {
    const { loads, status, workers } = doc;
    const models = instanceModels(doc);
    const healthy = status.ok && status.segment.sidecar_alive;
    setValue("health", healthy ? "ok" : "degraded", healthy ? "ok" : "degraded");
    $("card-health").dataset.state = healthy ? "alive" : "dead";
    const link = schedulerState(status.scheduler);
    setValue("scheduler-state", link.state, link.text);
    $("card-scheduler").dataset.state = link.state === "registered" ? "alive" : link.state === "off" ? "" : "stale";
    setText("scheduler-note", link.note);
    const count = (states) => models.filter((m) => states.includes(m.liveness)).length;
    setValue("pool-alive", count(["alive"]), String(count(["alive"])));
    setValue("pool-stale", count(["stale"]), String(count(["stale"])));
    setValue("pool-dead", count(["dead", "unhealthy"]), String(count(["dead", "unhealthy"])));
    setText("sum-instances", `${status.alive_instances} / ${status.total_instances}`);
    setText("sum-inflight", String(loads.instances.reduce((sum, r) => sum + (r.inflight || 0), 0)));
    const backlogs = loads.instances.map((r) => r.predicted_total_backlog_ms).filter(known);
    const worst = backlogs.length ? Math.max(...backlogs) : null;
    setValue("sum-backlog", worst, fmtMs(worst));
    setText("sum-workers", `${workers.filter((w) => w.alive).length} / ${workers.length}`);
    setValue("snapshot-age", loads.snapshot_age_ms, fmtMs(loads.snapshot_age_ms));
    setText("snapshot-state", `pressure: ${loads.metric_source.predicted_pressure}`);
    const channel = status.event_channel;
    setText("ev-consumed", fmtInt(channel.events_consumed));
    setText("ev-dropped", fmtInt(channel.events_dropped_by_workers));
    setText("ev-lag", String(workers.reduce((sum, w) => sum + w.events_pending, 0)));
    const full = workers.filter((w) => w.ring_full).length;
    setText("ev-spill", full ? `${full} ring(s) full: workers spilling` : "none spilling");
  }

  // /debug/status → scheduler (sidecar/scheduler_link.py).
  function schedulerState(link) {
    if (!link || !link.enabled) return { state: "off", text: "off", note: "SCHEDULER_CP_URL not set" };
    const failing = link.consecutive_failures ? `${link.consecutive_failures} failing · ` : "";
    const heard = known(link.last_success_age_s) ? `last answer ${link.last_success_age_s.toFixed(1)} s ago` : "never answered";
    if (link.registered) return { state: "registered", text: "registered", note: `${link.proxy_id} · ${failing}${heard}` };
    return { state: "unregistered", text: link.waiting_for_workers ? "waiting" : "not registered",
             note: `${failing}${link.last_error || heard}` };
  }

  function renderInstanceViews(doc) {
    const models = instanceModels(doc);
    const shown = visible(models);
    setText("inst-count", shown.length === models.length ? `${models.length} instances`
      : `showing ${shown.length} of ${models.length}`);
    const ordered = sorted("instances", shown, (m, key) => m[key]);  // one order for the three views
    renderInstances(ordered, models.length);
    renderResources(ordered);
    renderProvenance(ordered);
  }

  function renderInstances(models, total) {
    const body = $("instances").tBodies[0];
    if (!models.length) {
      body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 18 },
        total ? "no instance matches the search or filter" : "no instances registered")));
      return;
    }
    body.replaceChildren(...models.map(instanceRow));
  }

  function instanceRow(m) {
    const score = m.score;
    const scoreCell = numCell("least_load_score", m.least_load_score, fmtNum(m.least_load_score, 2));
    scoreCell.title = Object.entries(score.weighted_components || {}).map(([k, v]) => `${k}: ${v}`).join("\n");
    return el("tr", { data: { instanceId: m.instance_id, liveness: m.liveness, inflight: fmtInt(m.inflight) } },
      el("td", { data: { field: "instance_id" } },
        el("div", { className: "id" }, swatch(palette.colorOf(m.instance_id)), m.instance_id),
        el("div", { className: "addr" }, `${m.address} · slot ${m.slot} gen ${m.slot_generation}`)),
      el("td", { data: { field: "liveness" } }, badge(m.liveness)),
      numCell("inflight", m.inflight, fmtInt(m.inflight), "strong"),
      numCell("active_prepare", m.active_prepare, fmtInt(m.active_prepare)),
      numCell("active_ready", m.active_ready, fmtInt(m.active_ready)),
      numCell("prepare_queue_depth", m.prepare_queue_depth, fmtInt(m.prepare_queue_depth)),
      numCell("ready_queue_depth", m.ready_queue_depth, fmtInt(m.ready_queue_depth)),
      numCell("pending_prefill_count", m.pending_prefill_count, fmtInt(m.pending_prefill_count)),
      numCell("active_decode_count", m.active_decode_count, fmtInt(m.active_decode_count)),
      numCell("next_slot_ready_in_ms", m.next_slot_ready_in_ms, fmtMs(m.next_slot_ready_in_ms)),
      numCell("prefill_free_in_ms", m.prefill_free_in_ms, fmtMs(m.prefill_free_in_ms)),
      numCell("predicted_total_backlog_ms", m.predicted_total_backlog_ms, fmtMs(m.predicted_total_backlog_ms)),
      numCell("qps_1m", m.qps_1m, fmtNum(m.qps_1m, 2)),
      numCell("cpu_util", m.cpu_util, fmtPct(m.cpu_util)),
      numCell("memory_pct", m.memory_pct, fmtPct(m.memory_pct)),
      numCell("gpu_util_avg", m.gpu_util_avg, fmtPct(m.gpu_util_avg)),
      numCell("heartbeat_age_ms", m.heartbeat_age_ms, fmtAgo(m.heartbeat_age_ms)),
      scoreCell);
  }

  function meter(field, label, value, pct, text) {
    const fill = el("span", { className: "fill" });
    fill.style.width = `${known(pct) ? Math.max(0, Math.min(100, pct)) : 0}%`;
    if (known(pct) && pct >= 90) fill.classList.add("hot");
    return el("div", { className: "meter", data: { field, value: known(value) ? String(value) : "" } },
      el("span", { className: "m-label" }, label), el("span", { className: "bar" }, fill),
      el("span", { className: "m-value" }, text));
  }

  function renderResources(models) {
    const grid = $("resources");
    if (!models.length) {
      grid.replaceChildren(el("p", { className: "muted" }, "no instances to show"));
      return;
    }
    const now = lastDoc ? lastDoc.generated_at_ms : Date.now();
    grid.replaceChildren(...models.map((m) => {
      const r = m.resource;
      const head = el("header", {}, swatch(palette.colorOf(m.instance_id)),
        el("span", { className: "id" }, m.instance_id), badge(m.liveness));
      const card = el("article", { className: "rcard", data: { instanceId: m.instance_id, liveness: m.liveness,
                                                                  hasResource: r ? "true" : "false" } }, head);
      if (!r) {
        card.append(el("div", { className: "addr" }, m.address),
          el("p", { className: "muted small empty-card" }, "no resource snapshot reported yet"));
        return card;
      }
      const memText = known(r.memory_used_mb) ? `${fmtMb(r.memory_used_mb)} / ${fmtMb(r.memory_total_mb)}` : "—";
      const gpuMem = known(r.gpu_mem_used_mb) ? ` · ${fmtMb(r.gpu_mem_used_mb)} / ${fmtMb(r.gpu_mem_total_mb)}` : "";
      const gpuMax = known(r.gpu_util_max) ? ` (max ${fmtPct(r.gpu_util_max)})` : "";
      const age = known(r.resource_reported_at) ? now - r.resource_reported_at * 1000 : null;
      const admission = r.admission_state || "unknown";
      card.append(
        el("div", { className: "addr" }, `${m.address} · admission `,
          el("span", { className: "badge", data: { state: admission === "accepting" ? "alive" : "stale", field: "admission_state" } }, admission)),
        meter("cpu_util", "CPU", r.cpu_util, r.cpu_util, fmtPct(r.cpu_util)),
        meter("memory_pct", "Memory", m.memory_pct, m.memory_pct, memText),
        meter("gpu_util_avg", "GPU", r.gpu_util_avg, r.gpu_util_avg, `${fmtPct(r.gpu_util_avg)}${gpuMax}`),
        el("div", { className: "meter-text", data: { field: "gpu_memory" } }, `GPU memory${gpuMem || " —"}`),
        el("div", { className: "net", data: { field: "network", rx: String(r.network_rx_mbps), tx: String(r.network_tx_mbps) } },
          el("span", {}, "↓ rx ", el("b", {}, fmtMbps(r.network_rx_mbps))),
          el("span", {}, "↑ tx ", el("b", {}, fmtMbps(r.network_tx_mbps)))),
        el("footer", { className: "muted small" }, `reported ${fmtAgo(age)}`,
          r.gpu_sample_source ? ` · gpu ${r.gpu_sample_source}${r.gpu_sample_quality ? ` (${r.gpu_sample_quality})` : ""}` : ""));
      return card;
    }));
  }

  const COMPONENT_COLORS = ["#2457c5", "#e07a1f", "#1d9a6c", "#c23b6e", "#7b4fd1", "#0f8fa8", "#b58a00", "#5d6b82"];

  /** What least_load's score is made of, per instance: weight × component, and where each came from. */
  function renderProvenance(models) {
    const weights = (models.find((m) => m.score.weights) || { score: {} }).score.weights || {};
    const names = Object.keys(weights);
    const colorOf = (name) => COMPONENT_COLORS[names.indexOf(name) % COMPONENT_COLORS.length];
    const sources = (models.find((m) => m.score.source) || { score: {} }).score.source || {};
    const legend = el("ul", { className: "legend components" }, ...names.map((name) =>
      el("li", { data: { component: name } }, swatch(colorOf(name)), `${name} × ${weights[name]}`,
        el("span", { className: "muted" }, ` · ${sources[name] || "unavailable"}`))));
    const totals = models.map((m) => m.least_load_score).filter(known);
    const top = Math.max(1e-9, ...totals);
    const rows = models.map((m) => {
      const parts = Object.entries(m.score.weighted_components || {});
      const bar = el("div", { className: "stack" }, ...parts.map(([name, value]) => {
        const seg = el("span", { className: "seg", data: { component: name } });
        seg.style.width = `${(100 * Math.max(0, value)) / top}%`;
        seg.style.background = colorOf(name);
        seg.title = `${name}: ${m.score.components[name]} × ${weights[name]} = ${value}`;
        return seg;
      }));
      // The components that add something; the rest are listed once, in the legend.
      const detail = parts.filter(([, value]) => value !== 0)
        .map(([name, value]) => `${name} ${fmtNum(m.score.components[name], 1)} × ${weights[name]} = ${fmtNum(value, 2)}`).join(" · ");
      return el("tr", { data: { instanceId: m.instance_id } },
        el("td", {}, el("div", { className: "id" }, swatch(palette.colorOf(m.instance_id)), m.instance_id)),
        numCell("total", m.least_load_score, fmtNum(m.least_load_score, 2), "strong"),
        el("td", { className: "stack-cell" }, bar, el("div", { className: "muted small" }, detail || (parts.length ? "every component is 0" : "no component known"))));
    });
    const table = el("table", { id: "provenance-table" },
      el("thead", {}, el("tr", {}, el("th", {}, "instance"), el("th", { className: "num" }, "score"), el("th", {}, "weighted components"))),
      el("tbody", {}, ...rows));
    const strategy = lastDoc ? lastDoc.loads.strategy : "";
    setText("provenance-note", strategy === "least_load" ? "least_load picks the lowest score"
      : `strategy is ${strategy}: the score is what least_load would compute`);
    $("provenance").replaceChildren(legend, table);
  }

  function renderWorkers(workers) {
    const body = $("workers").tBodies[0];
    if (!workers.length) {
      body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 8 }, "no worker rows claimed")));
      return;
    }
    body.replaceChildren(...sorted("workers", workers, (w, key) => w[key]).map((w) => {
      const state = w.alive ? "alive" : "dead";
      const held = el("td", { className: "num strong", data: { field: "inflight_held", value: String(w.inflight_held) } },
        String(w.inflight_held));
      held.title = Object.entries(w.inflight_by_instance).map(([id, n]) => `${id}: ${n}`).join("\n");
      return el("tr", { data: { pid: String(w.pid), workerIndex: String(w.worker_index), alive: String(w.alive),
                                inflightHeld: String(w.inflight_held) } },
        numCell("worker_index", w.worker_index, String(w.worker_index)),
        numCell("pid", w.pid, String(w.pid)),
        numCell("row", w.row, String(w.row)),
        el("td", {}, badge(state)),
        numCell("heartbeat_age_ms", w.heartbeat_age_ms, fmtMs(w.heartbeat_age_ms)),
        held,
        numCell("events_pending", w.events_pending, `${w.events_pending} / ${w.ring_capacity}`),
        numCell("events_dropped", w.events_dropped, String(w.events_dropped)));
    }));
  }

  function definitions(id, items) {
    const shown = (v) => !known(v) ? "—" : typeof v === "number" && !Number.isInteger(v) ? v.toFixed(2) : String(v);
    $(id).replaceChildren(...items.flatMap(([label, value, key]) => [
      el("dt", {}, label), el("dd", { data: { field: key, value: known(value) ? String(value) : "" } }, shown(value))]));
  }

  function renderChannel(status, workers) {
    const c = status.event_channel, seg = status.segment, reaper = status.reaper;
    definitions("channel", [
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
      ["scheduler link", schedulerState(status.scheduler).text, "scheduler"],
    ]);
  }

  function renderScheduler(link, pool) {
    link = link || { enabled: false };
    definitions("scheduler", [
      ["state", schedulerState(link).text, "state"],
      ["scheduler", link.url, "url"],
      ["proxy id", link.proxy_id, "proxy_id"],
      ["advertised", link.advertised ? JSON.stringify(link.advertised) : null, "advertised"],
      ["registrations", link.registrations, "registrations"],
      ["heartbeats ok", link.heartbeats_ok, "heartbeats_ok"],
      ["failing in a row", link.consecutive_failures, "consecutive_failures"],
      ["last error", link.last_error, "last_error"],
    ]);
    const items = [];
    for (const [key, value] of Object.entries(pool || {})) {
      if (key === "metric_source" || key === "metric_quality") continue;  // in the raw JSON
      if (key === "generated_at") { items.push([key, new Date(value * 1000).toLocaleTimeString(), key]); continue; }
      if (value && typeof value === "object") {
        for (const [sub, v] of Object.entries(value)) {
          items.push([`${key}.${sub}`, v && typeof v === "object" ? JSON.stringify(v) : v, `${key}.${sub}`]);
        }
      } else items.push([key, value, key]);
    }
    definitions("pool-resource", items);
  }

  function renderTopology(topology) {
    const merged = topology.kdn_links || {}, perInstance = topology.per_instance || {}, configured = topology.configured || {};
    const links = Object.entries(merged).map(([key, link]) => ({ key, source: `measured · best from ${link.reported_by}`,
      bandwidth_mbps: link.bandwidth_mbps, latency_ms: link.latency_ms,
      reporters: Object.keys(perInstance).filter((id) => key in perInstance[id]).join(", ") }));
    for (const [key, link] of Object.entries(configured)) {
      if (!(key in merged)) links.push({ key, source: "configured (PROXY_KDN_LINKS_JSON)", bandwidth_mbps: link.bandwidth_mbps,
                                          latency_ms: known(link.latency_ms) ? link.latency_ms : link.rtt_ms, reporters: "" });
    }
    setText("topology-note", `${Object.keys(merged).length} measured, ${Object.keys(configured).length} configured · from /v1/topology/kdn_links`);
    const body = $("kdn-links").tBodies[0];
    if (!links.length) {
      body.replaceChildren(el("tr", { className: "empty" }, el("td", { colspan: 5 }, "no KDN link reported or configured")));
      return;
    }
    body.replaceChildren(...sorted("kdn-links", links, (l, key) => l[key]).map((l) =>
      el("tr", { data: { kdn: l.key } },
        el("td", { data: { field: "key" } }, el("code", {}, l.key)),
        el("td", { data: { field: "source" } }, l.source),
        numCell("bandwidth_mbps", l.bandwidth_mbps, fmtMbps(l.bandwidth_mbps)),
        numCell("latency_ms", l.latency_ms, fmtMs(l.latency_ms)),
        el("td", { data: { field: "reporters" } }, l.reporters || "—"))));
  }

  // Affinity is not built yet: the panel shows only when the sidecar sends something for it.
  function renderAffinity(affinity) {
    const present = known(affinity);
    $("affinity-panel").hidden = !present;
    if (present) $("affinity").textContent = JSON.stringify(affinity, null, 2);
  }

  function rawPart(doc, source) {
    if (!doc) return null;
    return source === "all" ? doc : doc[source];
  }

  function renderRaw(doc, force) {
    const pre = $("raw-json");
    // Leave the text alone while someone is selecting in it.
    const selection = window.getSelection();
    if (!force && selection && !selection.isCollapsed && pre.contains(selection.anchorNode)) return;
    pre.textContent = JSON.stringify(rawPart(doc, $("raw-source").value), null, 2);
    pre.dataset.source = $("raw-source").value;
  }

  function drawCharts() {
    const now = lastDoc.generated_at_ms / 1000, span = prefs.historyS;
    const byInstance = (name) => {
      const data = history[name].window(span, now);
      const series = [...data.series.keys()].map((key) => ({ key, color: palette.colorOf(key) }));
      charts[name].draw(series, data, span, now);
      return data;
    };
    const inflight = byInstance("inflight");
    for (const name of ["backlog", "queue", "cpu", "memory", "gpu"]) byInstance(name);
    const net = history.network.window(span, now);
    charts.network.draw([...net.series.keys()].map((key) => {
      const [id, dir] = key.split("\u0000");
      return { key, color: palette.colorOf(id), dash: dir === "tx" };
    }), net, span, now);
    const pool = history.pool.window(span, now);
    charts.pool.draw(["alive", "stale", "out"].filter((k) => pool.series.has(k))
      .map((key) => ({ key, color: POOL_COLORS[key] })), pool, span, now);
    $("legend").replaceChildren(...[...inflight.series.keys()].map((id) =>
      el("li", { data: { instanceId: id } }, swatch(palette.colorOf(id)), id)));
  }

  applyTheme();
  applyPaused();
  schedule(0);
})();
