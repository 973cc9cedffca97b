// kvserve's built-in page: Compare, Live and Sums views over the server's JSON routes (/info, /ui/api/*).
// Plain browser JavaScript, no build step, nothing fetched from elsewhere.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const KEY_STORE = "kvserve-api-key";
let info = null;            // GET /info, once
let liveTimer = null;       // the Live view's poll, while it is shown
let lastLive = null;        // the previous /ui/api/live answer (for tokens/s)

// ---- talking to the server ------------------------------------------------------------------------------

class ServerError extends Error {}

function showError(message) {
  const box = $("#error");
  box.textContent = message;
  box.hidden = !message;
}

// fetch JSON with the API key when one was given; 401 asks for the key once and retries.
async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers["Authorization"] = "Bearer " + key;
  let response;
  try {
    response = await fetch(path, Object.assign({}, options, { headers }));
  } catch (err) {
    throw new ServerError(`cannot reach the server (${err.message})`);
  }
  if (response.status === 401) {
    sessionStorage.removeItem(KEY_STORE);
    await askForKey(key ? "That key was refused; try again." : "");
    return api(path, options);
  }
  let body = null;
  const text = await response.text();
  try { body = text ? JSON.parse(text) : null; } catch (_) { body = null; }
  if (!response.ok) {
    // TGI-style {error, error_type} (OpenAI's nested form just in case), else the status line
    const msg = body && (typeof body.error === "string" ? body.error : body.error && body.error.message);
    throw new ServerError(`${path}: ${response.status} ${msg || response.statusText || "error"}`);
  }
  return body;
}

let keyWaiters = null;
function askForKey(note) {
  if (!keyWaiters) {
    keyWaiters = [];
    const form = $("#key-form");
    form.hidden = false;
    if (note) showError(note);
    $("#key").focus();
  }
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function initKeyForm() {
  $("#key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("#key").value.trim());
    $("#key").value = "";
    $("#key-form").hidden = true;
    showError("");
    const waiters = keyWaiters || [];
    keyWaiters = null;
    waiters.forEach((resolve) => resolve());
  });
}

// ---- formatting -----------------------------------------------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${Math.round(n)} B` : `${n.toFixed(2)} ${units[i]}`;
}
const ms = (s) => (s === null || s === undefined ? "–" : `${(s * 1000).toFixed(1)} ms`);
const int = (n) => Math.round(n).toLocaleString("en-US");

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}

// ---- views ----------------------------------------------------------------------------------------------

function selectView(name, focus = false) {
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    const on = tab.dataset.view === name;
    tab.setAttribute("aria-selected", on ? "true" : "false");
    tab.tabIndex = on ? 0 : -1;
    $("#" + tab.getAttribute("aria-controls")).hidden = !on;
    if (on && focus) tab.focus();
  }
  const url = new URL(location.href);
  if (name === "compare") url.searchParams.delete("view"); else url.searchParams.set("view", name);
  history.replaceState(null, "", url);
  clearInterval(liveTimer);
  liveTimer = null;
  if (name === "live") { lastLive = null; pollLive(); liveTimer = setInterval(pollLive, 1000); }
  if (name === "sums" && !$("#sums-table tbody").children.length) loadSums();
}

function initTabs() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => selectView(tab.dataset.view));
    tab.addEventListener("keydown", (ev) => {  // arrow keys move between tabs (WAI-ARIA tabs pattern)
      const step = { ArrowRight: 1, ArrowLeft: -1 }[ev.key];
      if (step) { ev.preventDefault(); selectView(tabs[(i + step + tabs.length) % tabs.length].dataset.view, true); }
    });
  });
}

// ---- Compare --------------------------------------------------------------------------------------------

function chosenBackends() {
  return [...document.querySelectorAll('#backends input[type="checkbox"]:checked')].map((b) => b.value);
}

function compareSettings() {
  const seeded = $('input[name="mode"]:checked').value === "seeded";
  return {
    prompt: $("#prompt").value,
    backends: chosenBackends(),
    max_new_tokens: Number($("#max-new-tokens").value),
    repetition_penalty: Number($("#repetition-penalty").value),
    seed: seeded ? Number($("#seed").value) : null,
    temperature: Number($("#temperature").value),
  };
}

function shareUrl(s) {
  const url = new URL(location.origin + location.pathname);
  url.searchParams.set("prompt", s.prompt);
  url.searchParams.set("backends", s.backends.join(","));
  url.searchParams.set("max_new_tokens", s.max_new_tokens);
  url.searchParams.set("repetition_penalty", s.repetition_penalty);
  if (s.seed !== null) { url.searchParams.set("seed", s.seed); url.searchParams.set("temperature", s.temperature); }
  return url;
}

// Fill the form from the query string; true when it describes a comparison to run.
function applyQuery() {
  const q = new URLSearchParams(location.search);
  if (q.has("prompt")) $("#prompt").value = q.get("prompt");
  if (q.has("max_new_tokens")) $("#max-new-tokens").value = q.get("max_new_tokens");
  if (q.has("repetition_penalty")) $("#repetition-penalty").value = q.get("repetition_penalty");
  if (q.has("seed")) {
    $('input[name="mode"][value="seeded"]').checked = true;
    $("#seed").value = q.get("seed");
    if (q.has("temperature")) $("#temperature").value = q.get("temperature");
  }
  if (q.has("backends")) {
    const wanted = q.get("backends").split(",");
    for (const box of document.querySelectorAll('#backends input[type="checkbox"]')) box.checked = wanted.includes(box.value);
  }
  return q.has("prompt") && q.has("backends");
}

function renderBackends() {
  const set = $("#backends");
  $("#backends-loading").remove();
  const usual = info.kv_backends.filter((n) => n === "full" || n === "int8");
  const picked = usual.length ? usual : info.kv_backends.slice(0, 2);
  info.kv_backends.forEach((name) => {
    const box = el("input", { type: "checkbox", value: name, name: "backend" });
    box.checked = picked.includes(name);
    set.append(el("label", {}, box, " " + name));
  });
}

// The index of the first token id that differs, or -1 when one output is the other (same ids, same length).
function firstDifference(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i].id !== b[i].id) return i;
  return a.length === b.length ? -1 : n;
}

// A small SVG plot of logprob(backend) - logprob(reference) per token position.
function diffPlot(result, ref, diverge) {
  const NS = "http://www.w3.org/2000/svg";
  const W = 320, H = 90, PAD = 4;
  const n = Math.min(result.tokens.length, ref.tokens.length);
  const d = [];
  for (let i = 0; i < n; i++) d.push(result.tokens[i].logprob - ref.tokens[i].logprob);
  const max = Math.max(0.05, ...d.map(Math.abs));  // nats; float noise stays flat, not full scale
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("class", "plot");
  svg.setAttribute("role", "img");
  const label = diverge < 0 ? "identical" : `first difference at token ${diverge}`;
  svg.setAttribute("aria-label", `log-probability difference from ${ref.kv_backend} per token, ` +
    `largest ${max.toFixed(3)} nats; ${label}`);
  const y = (v) => H / 2 - (v / max) * (H / 2 - PAD);
  const x = (i) => PAD + (n <= 1 ? 0 : (i * (W - 2 * PAD)) / (n - 1));
  const add = (tag, attrs) => { const e = document.createElementNS(NS, tag); for (const k in attrs) e.setAttribute(k, attrs[k]); svg.append(e); return e; };
  add("line", { x1: 0, x2: W, y1: H / 2, y2: H / 2, class: "axis" });
  if (diverge >= 0 && diverge < n) add("line", { x1: x(diverge), x2: x(diverge), y1: 0, y2: H, class: "diverge-line" });
  const bw = Math.max(1, (W - 2 * PAD) / Math.max(n, 1) - 1);
  d.forEach((v, i) => {
    const top = Math.min(y(v), H / 2), h = Math.max(0.5, Math.abs(y(v) - H / 2));
    add("rect", { x: x(i) - bw / 2, y: top, width: bw, height: h, class: diverge >= 0 && i > diverge ? "bar faint" : "bar" })
      .append(Object.assign(document.createElementNS(NS, "title"), { textContent: `token ${i}: ${v.toFixed(4)}` }));
  });
  const caption = el("figcaption", { class: "muted", text: `Δ log-prob vs ${ref.kv_backend}: ±${max.toFixed(3)} nats full scale` });
  return el("figure", {}, svg, caption);
}

function renderResult(result, ref) {
  const diverge = ref && ref !== result ? firstDifference(result.tokens, ref.tokens) : -1;
  const text = el("p", { class: "text" });
  text.append(el("span", { class: "prompt", text: $("#prompt").value }));
  result.tokens.forEach((t, i) => {
    if (i === diverge) {
      text.append(el("mark", { class: "diverge", title: `first token that differs from ${ref.kv_backend}`,
                               "data-index": String(i), text: t.text || "⟨" + t.id + "⟩" }));
    } else {
      text.append(el("span", { text: t.text }));
    }
  });
  let verdict;
  if (!ref || ref === result) verdict = "reference";
  else if (diverge < 0) verdict = `identical to ${ref.kv_backend}`;
  else verdict = `differs from ${ref.kv_backend} at token ${diverge}`;
  const stats = el("dl", { class: "stats" },
    el("dt", { text: "KV peak" }), el("dd", { class: "kv-peak", "data-bytes": String(result.kv_peak_bytes), text: bytes(result.kv_peak_bytes) }),
    el("dt", { text: "KV bytes/token" }), el("dd", { class: "kv-per-token", text: int(result.kv_bytes_per_token) }),
    el("dt", { text: "TTFT" }), el("dd", { class: "ttft", text: ms(result.ttft_s) }),
    el("dt", { text: "TPOT" }), el("dd", { class: "tpot", text: ms(result.tpot_s) }),
    el("dt", { text: "tokens" }), el("dd", { text: `${result.prompt_tokens} prompt + ${result.tokens.length} new (${result.finish_reason})` }));
  const card = el("article", { class: "result", "data-backend": result.kv_backend,
                               "data-diverge": !ref || ref === result ? "reference" : String(diverge) },
    el("h2", { text: result.kv_backend }), el("p", { class: "verdict", text: verdict }), text, stats);
  if (ref && ref !== result) card.append(diffPlot(result, ref, diverge));
  return card;
}

async function runCompare(ev) {
  if (ev) ev.preventDefault();
  const s = compareSettings();
  showError("");
  if (!s.prompt.trim()) { showError("Type a prompt first."); $("#prompt").focus(); return; }
  if (!s.backends.length) { showError("Choose at least one backend."); return; }
  history.replaceState(null, "", shareUrl(s));
  $("#copy-link").hidden = false;
  const results = $("#results");
  results.replaceChildren();
  $("#run").disabled = true;
  // the reference runs first, so that each card can be drawn against it as it arrives
  const order = s.backends.includes("full") ? ["full", ...s.backends.filter((b) => b !== "full")] : s.backends;
  const done = [];
  try {
    for (const [i, backend] of order.entries()) {
      $("#compare-status").textContent = `running ${backend} (${i + 1}/${order.length})…`;
      const body = { prompt: s.prompt, kv_backend: backend, max_new_tokens: s.max_new_tokens,
                     repetition_penalty: s.repetition_penalty, seed: s.seed, temperature: s.temperature };
      const result = await api("/ui/api/generate", { method: "POST", headers: { "Content-Type": "application/json" },
                                                    body: JSON.stringify(body) });
      done.push(result);
      results.append(renderResult(result, done[0]));
    }
    $("#compare-status").textContent = `done: ${order.join(", ")}`;
  } catch (err) {
    showError(err.message);
    $("#compare-status").textContent = "";
  } finally {
    $("#run").disabled = false;
  }
}

// ---- Live -----------------------------------------------------------------------------------------------

async function pollLive() {
  let now;
  try {
    now = await api("/ui/api/live");
  } catch (err) {
    showError(err.message);
    return;
  }
  const body = $("#live-table tbody");
  body.replaceChildren();
  const budget = now.kv_cache_budget_bytes;
  $("#live-budget").textContent = budget ? `KV budget (KV_CACHE_BUDGET_BYTES): ${bytes(budget)}.`
                                         : "No KV budget set (KV_CACHE_BUDGET_BYTES): the bars are against the largest in use.";
  const rows = Object.entries(now.backends);
  const scale = budget || Math.max(1, ...rows.map(([, r]) => r.kv_bytes));
  for (const [name, r] of rows) {
    const prev = lastLive && lastLive.backends[name];
    const dt = lastLive ? now.time - lastLive.time : 0;
    const rate = prev && dt > 0 ? Math.max(0, (r.generated_tokens - prev.generated_tokens) / dt) : 0;
    const bar = el("meter", { min: "0", max: String(scale), value: String(r.kv_bytes), "aria-label": `${name} KV allocated against ${budget ? "the budget" : "the largest"}` });
    body.append(el("tr", { "data-backend": name },
      el("th", { scope: "row", text: name }),
      el("td", { class: "running", text: String(r.running) }),
      el("td", { class: "waiting", text: String(r.waiting) }),
      el("td", { class: "rate", text: rate.toFixed(1) }),
      el("td", { class: "kv-used", "data-bytes": String(r.kv_used_bytes), text: bytes(r.kv_used_bytes) }),
      el("td", { class: "kv-allocated", "data-bytes": String(r.kv_bytes) }, bar, " " + bytes(r.kv_bytes)),
      el("td", { class: "kv-tokens", text: int(r.kv_tokens) }),
      el("td", { class: "requests", text: int(r.requests) })));
  }
  lastLive = now;
  $("#live-updated").textContent = "updated " + new Date().toLocaleTimeString();
  showError("");
}

// ---- Sums -----------------------------------------------------------------------------------------------

async function loadSums(ev) {
  if (ev) ev.preventDefault();
  const seqLen = Number($("#seq-len").value), batch = Number($("#batch").value);
  let sums;
  try {
    sums = await api(`/ui/api/sums?seq_len=${encodeURIComponent(seqLen)}&batch=${encodeURIComponent(batch)}`);
  } catch (err) {
    showError(err.message);
    return;
  }
  showError("");
  $("#sums-caption").textContent = `kvserve estimate for ${sums.model} (${sums.dtype}, ${sums.num_layers} layers) ` +
    `at ${int(sums.seq_len)} tokens × ${int(sums.batch)} sequences; each backend at the estimator's defaults for the model, and each served backend's own settings.`;
  const body = $("#sums-table tbody");
  body.replaceChildren();
  for (const r of sums.rows) {
    const params = Object.entries(r.params).map(([k, v]) => `${k}=${v}`).join(",") || "-";
    body.append(el("tr", { "data-backend": r.backend },
      el("th", { scope: "row", text: r.backend }), el("td", { text: params }),
      el("td", { text: int(r.bytes_per_token_per_layer) }), el("td", { text: int(r.bytes_per_token) }),
      el("td", { class: "total", text: bytes(r.total_bytes) }),
      el("td", { text: r.vs_full ? `${r.vs_full.toFixed(2)}x` : "–" }),
      el("td", { text: r.served_as.join(", ") || "" })));
  }
}

// ---- start ----------------------------------------------------------------------------------------------

async function start() {
  initKeyForm();
  initTabs();
  $("#compare-form").addEventListener("submit", runCompare);
  $("#prompt").addEventListener("keydown", (ev) => {  // Ctrl+Enter (Cmd+Enter) runs the comparison
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) runCompare(ev);
  });
  $("#copy-link").addEventListener("click", async () => {
    try { await navigator.clipboard.writeText(location.href); $("#compare-status").textContent = "link copied"; }
    catch (_) { $("#compare-status").textContent = location.href; }
  });
  $("#sums-form").addEventListener("submit", loadSums);
  const q = new URLSearchParams(location.search);
  if (q.has("seq_len")) $("#seq-len").value = q.get("seq_len");
  if (q.has("batch")) $("#batch").value = q.get("batch");
  try {
    info = await api("/info");
  } catch (err) {
    showError(err.message + " — is the model still loading? Reload in a moment.");
    return;
  }
  $("#model").textContent = `${info.model_id} · ${info.model_dtype} on ${info.model_device_type} · default backend ${info.kv_backend}`;
  renderBackends();
  const run = applyQuery();
  selectView(q.get("view") || "compare");
  if (run && (q.get("view") || "compare") === "compare") runCompare();
}

document.addEventListener("DOMContentLoaded", start);
