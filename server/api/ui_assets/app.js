// kvserve's built-in page: Compare, Live and Sums views over the server's JSON routes (/info, /ui/api/*).
// Plain browser JavaScript, no build step, nothing fetched from elsewhere.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const KEY_STORE = "kvserve-api-key";
let info = null;            // GET /info, once
let defaults = null;        // GET /ui/api/defaults, once: the served model's presets, penalty, chat switch
let liveTimer = null;       // the Live view's poll, while it is shown
let lastLive = null;        // the previous /ui/api/live answer (for tokens/s)

// ---- talking to the server ------------------------------------------------------------------------------

class ServerError extends Error {
  constructor(message, status = null) { super(message); this.status = status; }  // status: null when unreachable
}

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
    throw new ServerError(`${path}: ${response.status} ${msg || response.statusText || "error"}`, response.status);
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
// Every ratio to full (or the reference) in one convention, as the start-up log and the README write them: a size
// "N.NNx smaller" (or larger), a time "N.NNx faster" (or slower); r is this / the reference.
function versusText(r, less, more, same) {
  if (r === null || r === undefined || !isFinite(r) || r <= 0) return "–";
  const times = (r < 1 ? 1 / r : r).toFixed(2);
  return times === "1.00" ? same : `${times}x ${r < 1 ? less : more}`;
}
const sizeRatio = (r) => versusText(r, "smaller", "larger", "same size");
const timeRatio = (r) => versusText(r, "faster", "slower", "same time");
// The quality budget's price of a served backend ({ppl_increase_pct, agreement, within_budget, budget_pct,
// min_agreement}): the perplexity increase, the top-1 agreement with full and the bounds it misses; or "not priced".
function priceText(p) {
  if (!p) return "not priced";
  const cost = `+${p.ppl_increase_pct.toFixed(2)}% perplexity, top-1 agreement ${p.agreement.toFixed(3)}`;
  if (p.within_budget) return cost;
  const over = `over the quality budget of +${p.budget_pct}%`, under = `top-1 agreement of ${p.min_agreement}`;
  if (!missesAgreement(p)) return `${cost}, ${over}`;
  return p.ppl_increase_pct > p.budget_pct ? `${cost}, ${over} and under its ${under}`
                                           : `${cost}, under the quality budget's ${under}`;
}
const missesAgreement = (p) => p.min_agreement !== null && p.min_agreement !== undefined
  && p.agreement < p.min_agreement;
// The over-budget flag of a summary row: the figure that misses the budget (the price first).
const budgetFlag = (p) => `⚠ over budget: ${p.ppl_increase_pct > p.budget_pct || !missesAgreement(p)
  ? `+${p.ppl_increase_pct.toFixed(2)}%` : `top-1 agreement ${p.agreement.toFixed(3)}`}`;
// The shortfall flag of a price under the agreement bound: by how much, and in its title whether the search served
// the closest setting it found because none reached the bound (null: no shortfall).
function shortfallFlag(p) {
  if (!p || !p.agreement_shortfall) return null;
  const by = p.agreement_shortfall.toFixed(4);
  const title = p.closest
    ? `no setting the search tried reaches the top-1 agreement of ${p.min_agreement}: the closest is served, ` +
      `${by} under it`
    : `top-1 agreement ${p.agreement.toFixed(3)}, ${by} under the quality budget's bound of ${p.min_agreement}`;
  return el("span", { class: "agreement-shortfall", "data-shortfall": String(p.agreement_shortfall), title,
                      text: `⚠ ${p.closest ? "closest setting: " : ""}agreement short by ${by}` });
}
// The long-context flag of a price whose backend loses on the quality budget's long input what its short price cannot
// show (retrieval under full's, or a long price over the budget): the warning in its title (null: none).
function longContextFlag(p) {
  if (!p || !p.long_context_warning) return null;
  return el("span", { class: "long-context-warning", title: p.long_context_warning,
                      text: "⚠ loses at long context" });
}
const sleep = (t) => new Promise((resolve) => setTimeout(resolve, t));

function median(values) {
  const v = values.filter((x) => x !== null && x !== undefined).sort((a, b) => a - b);
  if (!v.length) return null;
  const mid = Math.floor(v.length / 2);
  return v.length % 2 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

// Each cell of a table's body gets its column's heading as data-label (shown beside it on a narrow screen).
function labelCells(table) {
  const heads = [...table.querySelectorAll("thead th")].map((th) => th.dataset.label || th.textContent.trim());
  for (const row of table.querySelectorAll("tbody tr")) {
    [...row.children].forEach((cell, i) => { if (heads[i]) cell.dataset.label = heads[i]; });
  }
}

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

const WARM_TOKENS = 2;      // each backend's untimed warm-up: the same prompt, this many new tokens

function chosenBackends() {
  return [...document.querySelectorAll('#backends input[type="checkbox"]:checked')].map((b) => b.value);
}

function compareSettings() {
  const seeded = $('input[name="mode"]:checked').value === "seeded";
  return {
    prompt: $("#prompt").value,
    chat: !$("#chat-switch").hidden && $("#chat").checked,
    backends: chosenBackends(),
    max_new_tokens: Number($("#max-new-tokens").value),
    repetition_penalty: Number($("#repetition-penalty").value),
    seed: seeded ? Number($("#seed").value) : null,
    temperature: Number($("#temperature").value),
    runs: Math.max(1, Math.min(10, Math.round(Number($("#runs").value) || 1))),
  };
}

function shareUrl(s) {
  const url = new URL(location.origin + location.pathname);
  url.searchParams.set("prompt", s.prompt);
  if (!$("#chat-switch").hidden) url.searchParams.set("chat", s.chat ? "1" : "0");
  url.searchParams.set("backends", s.backends.join(","));
  url.searchParams.set("max_new_tokens", s.max_new_tokens);
  url.searchParams.set("repetition_penalty", s.repetition_penalty);
  url.searchParams.set("runs", s.runs);
  if (s.seed !== null) { url.searchParams.set("seed", s.seed); url.searchParams.set("temperature", s.temperature); }
  return url;
}

// Fill the form from the query string; true when it describes a comparison to run.
function applyQuery() {
  const q = new URLSearchParams(location.search);
  if (q.has("prompt")) $("#prompt").value = q.get("prompt");
  if (q.has("chat")) $("#chat").checked = q.get("chat") === "1";
  if (q.has("max_new_tokens")) $("#max-new-tokens").value = q.get("max_new_tokens");
  if (q.has("repetition_penalty")) $("#repetition-penalty").value = q.get("repetition_penalty");
  if (q.has("runs")) $("#runs").value = q.get("runs");
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

// The served model's presets, repetition penalty and chat-template switch (GET /ui/api/defaults): chat questions
// through the template for a chat model, text to continue for any other; the first preset is the default prompt.
function renderDefaults() {
  const select = $("#preset");
  select.querySelectorAll('option:not([value=""])').forEach((o) => o.remove());
  const how = defaults.chat ? " as a chat turn" : "";
  for (const p of defaults.presets) select.append(el("option", { value: p.prompt, text: `${p.label} (${p.tokens} tokens${how})` }));
  $("#chat-switch").hidden = !defaults.chat_template;
  $("#chat").checked = defaults.chat;
  $("#repetition-penalty").value = String(defaults.repetition_penalty);
  if (!$("#prompt").value && defaults.presets.length) $("#prompt").value = defaults.presets[0].prompt;
}

function renderBackends() {
  const set = $("#backends");
  set.querySelectorAll("label, .muted").forEach((n) => n.remove());
  const usual = info.kv_backends.filter((n) => n === "full" || n === "int8");
  const picked = usual.length ? usual : info.kv_backends.slice(0, 2);
  info.kv_backends.forEach((name) => {
    const box = el("input", { type: "checkbox", value: name, name: "backend" });
    box.checked = picked.includes(name);
    const quality = (info.kv_quality || {})[name];
    set.append(el("label", quality ? { title: quality.message } : {}, box, " " + name));
  });
  // the quality budget's warnings (KV_QUALITY_BUDGET): a backend over it, or one that saves nothing within it
  Object.entries(info.kv_quality || {}).forEach(([name, q]) => {
    if (qualityWarning(name)) set.append(el("p", { class: "muted quality-warning", "data-backend": name, text: "⚠ " + q.message }));
    const long = q.long_context_warning || q.window_warning;  // what the short price cannot show
    if (long) set.append(el("p", { class: "muted long-context-warning", "data-backend": name, text: "⚠ " + long }));
  });
}

// A served backend's price from the quality budget, as /ui/api/sums gives a row's (null: not priced).
function servedPrice(name) {
  const q = (info.kv_quality || {})[name];
  return q && q.price ? { served_as: name, ppl_increase_pct: q.price.ppl_increase_pct, agreement: q.price.agreement,
                          within_budget: q.within_budget, budget_pct: q.budget_pct,
                          min_agreement: q.min_agreement, agreement_shortfall: q.agreement_shortfall,
                          closest: Boolean(q.agreement_shortfall && q.searched && !q.explicit),
                          long_context_warning: q.long_context_warning || null } : null;
}

// The quality budget's word on a served backend when the user should hear it: over the budget, or no saving.
function qualityWarning(name) {
  const q = (info.kv_quality || {})[name];
  return q && name !== "full" && (q.saves_nothing || !q.within_budget) ? q.message : null;
}

// The index of the first token id that differs, or -1 when one output is the other (same ids, same length).
function firstDifference(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i].id !== b[i].id) return i;
  return a.length === b.length ? -1 : n;
}

// Tokens equal to the reference's at the same position, and the share of the longer output they are.
function agreement(a, b) {
  const n = Math.min(a.length, b.length);
  let equal = 0;
  for (let i = 0; i < n; i++) if (a[i].id === b[i].id) equal++;
  const of = Math.max(a.length, b.length);
  return { equal, of, share: of ? equal / of : 1 };
}

function logprobDiffs(result, ref) {
  const n = Math.min(result.tokens.length, ref.tokens.length);
  const d = [];
  for (let i = 0; i < n; i++) d.push(result.tokens[i].logprob - ref.tokens[i].logprob);
  return d;
}

// A small SVG plot of logprob(backend) - logprob(reference) per token position, at ±scale nats full scale
// (one scale for every card: the largest difference of any of them).
function diffPlot(result, ref, diverge, scale) {
  const NS = "http://www.w3.org/2000/svg";
  const W = 320, H = 90, PAD = 4;
  const d = logprobDiffs(result, ref), n = d.length;
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("class", "plot");
  svg.setAttribute("role", "img");
  svg.dataset.scale = String(scale);
  const label = diverge < 0 ? "identical" : `first difference at token ${diverge}`;
  const largest = Math.max(0, ...d.map(Math.abs));
  svg.setAttribute("aria-label", `log-probability difference from ${ref.kv_backend} per token, ` +
    `largest ${largest.toFixed(3)} nats of ±${scale.toFixed(3)} full scale; ${label}`);
  const y = (v) => H / 2 - (v / scale) * (H / 2 - PAD);
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
  const caption = el("figcaption", { class: "muted plot-scale",
    text: `Δ log-prob vs ${ref.kv_backend}: ±${scale.toFixed(3)} nats full scale (the same on every card)` });
  return el("figure", {}, svg, caption);
}

// What one backend's run means against the reference's: ratios, agreement, the first difference.
function versus(result, ref, timing, refTiming) {
  const same = !ref || ref === result;
  const diverge = same ? -1 : firstDifference(result.tokens, ref.tokens);
  const div = (a, b) => (a === null || a === undefined || !b ? null : a / b);
  return {
    diverge, reference: same,
    agree: same ? null : agreement(result.tokens, ref.tokens),
    // against full's bytes for the same tokens (the server's sums): the ratio of the peaks is that of bytes/token
    peak: result.kv_peak_bytes / result.kv_full_peak_bytes,
    ttft: div(median(timing.ttft), ref && median(refTiming.ttft)),
    tpot: div(median(timing.tpot), ref && median(refTiming.tpot)),
  };
}

// A run whose only token was end-of-text: the model stopped at once, leaving no text to compare.
const stoppedAtOnce = (r) => r.finish_reason === "eos_token" && r.tokens.length <= 1;
const TIMING_NONE = { ttft: "no token generated", tpot: "one token a run: TPOT needs two" };

function timingText(values, none) {
  const m = median(values), v = values.filter((x) => x !== null && x !== undefined);
  if (m === null) return none;
  return v.length > 1 ? `${ms(m)} (${spread(v)})` : ms(m);
}

function spread(v) { return `${(Math.min(...v) * 1000).toFixed(1)}–${(Math.max(...v) * 1000).toFixed(1)} ms`; }

// A card's timing: the median, then what it is (warm, median of N runs) and the spread, on a line of its own;
// runs that measured nothing (a TPOT of one token) are counted as such.
function setTiming(dd, values, none) {
  const v = values.filter((x) => x !== null && x !== undefined);
  const of = v.length < values.length ? ` of ${values.length} runs` : "";
  let detail = `warm, median of ${v.length}${of}: ${spread(v)}`;
  if (!v.length) detail = `${values.length} run${values.length === 1 ? "" : "s"}, ${none}`;
  else if (v.length === 1) detail = `warm, 1${of || " run"}`;
  dd.replaceChildren(el("span", { class: "key", text: ms(median(v)) }), el("span", { class: "detail muted", text: detail }));
}

function timingLabel(n) { return `warm, median of ${n}` + (n > 1 ? " (min–max)" : ""); }

function renderCard(result, ref, timing) {
  const vs = versus(result, ref, timing, timing);
  const text = el("p", { class: "text" });
  result.tokens.forEach((t, i) => {
    if (i === vs.diverge) {
      text.append(el("mark", { class: "diverge", title: `first token that differs from ${ref.kv_backend}`,
                               "data-index": String(i), text: t.text || "⟨" + t.id + "⟩" }));
    } else {
      text.append(el("span", { text: t.text }));
    }
  });
  let verdict;
  if (vs.reference) verdict = "reference";
  else if (vs.diverge < 0) verdict = `identical to ${ref.kv_backend}`;
  else verdict = `differs from ${ref.kv_backend} at token ${vs.diverge}`;
  if (stoppedAtOnce(result)) verdict += "; stopped at once: end-of-text only";
  const stats = el("dl", { class: "stats" },
    el("dt", { text: "KV peak" }), el("dd", { class: "kv-peak", "data-bytes": String(result.kv_peak_bytes), text: bytes(result.kv_peak_bytes) }),
    el("dt", { text: "KV bytes/token" }), el("dd", { class: "kv-per-token", text: int(result.kv_bytes_per_token) }),
    el("dt", { text: "TTFT" }), el("dd", { class: "ttft" }),
    el("dt", { text: "TPOT" }), el("dd", { class: "tpot" }),
    el("dt", { text: "tokens" }), el("dd", { text: `${result.prompt_tokens} prompt + ${result.tokens.length} new (${result.finish_reason})` }));
  const card = el("article", { class: "result", "data-backend": result.kv_backend,
                               "data-diverge": vs.reference ? "reference" : String(vs.diverge) },
    el("h2", { text: result.kv_backend }), el("p", { class: "verdict", text: verdict }));
  if (qualityWarning(result.kv_backend)) card.append(el("p", { class: "quality-warning", text: "⚠ " + qualityWarning(result.kv_backend) }));
  if (result.kv_uncompressed_reason) {
    card.append(el("p", { class: "uncompressed", text: `Not compressed yet: ${result.kv_uncompressed_reason}.` }));
  }
  card.append(text, stats);
  return card;
}

// Redraw every card's timings (as the runs come in) and plot (on the one scale of all of them).
function refreshCards(order, results, timings) {
  const ref = results[order[0]];
  const others = order.filter((b) => results[b] && results[b] !== ref);
  const scale = Math.max(0.05, ...others.flatMap((b) => logprobDiffs(results[b], ref).map(Math.abs)));  // nats
  for (const b of order) {
    const card = $(`#results .result[data-backend="${CSS.escape(b)}"]`);
    if (!card) continue;
    setTiming($(".ttft", card), timings[b].ttft, TIMING_NONE.ttft);
    setTiming($(".tpot", card), timings[b].tpot, TIMING_NONE.tpot);
    if (results[b] === ref) continue;
    const old = $("figure", card);
    const plot = diffPlot(results[b], ref, firstDifference(results[b].tokens, ref.tokens), scale);
    if (old) old.replaceWith(plot); else card.append(plot);
  }
}

// What the summary says when the reference stopped at once: nothing to compare, and what to try.
function stopNotice(name, chat) {
  const hint = !chat && defaults && defaults.chat ? "this is a chat model: turn on “chat template” or try another prompt"
                                                  : "try another prompt";
  return `${name} stopped at once: its only token was end-of-text, so there is no text to compare the backends ` +
    `on (agreement left out); ${hint}.`;
}

// One row per backend: its measures as ratios to the reference's (full when chosen), agreement, first difference;
// a backend over the quality budget is flagged with its price.
function renderSummary(order, results, timings, s) {
  const ref = results[order[0]], greedy = s.seed === null, nothing = stoppedAtOnce(ref);
  const runsDone = Math.min(...order.filter((b) => results[b]).map((b) => timings[b].ttft.length));
  const table = $("#summary-table");
  const refName = ref.kv_backend;
  $("#summary-ref").textContent = refName;
  table.querySelector(".th-ttft").textContent = `TTFT vs ${refName}`;
  table.querySelector(".th-tpot").textContent = `TPOT vs ${refName}`;
  table.querySelector(".th-agree").textContent = greedy ? `greedy agreement with ${refName}` : `agreement with ${refName} (seeded)`;
  $("#summary-timing").textContent = `TTFT and TPOT: ${timingLabel(runsDone)} per backend, each after one untimed ` +
    `warm-up run; runs interleaved across backends, every run prefilling its whole prompt (no prefix-cache hit).`;
  $("#summary-notice").textContent = nothing ? stopNotice(refName, s.chat) : "";
  $("#summary-notice").hidden = !nothing;
  const body = table.querySelector("tbody");
  body.replaceChildren();
  for (const b of order) {
    const r = results[b];
    if (!r) continue;
    const vs = versus(r, ref, timings[b], timings[order[0]]);
    const cell = (cls, main, detail, data = {}) =>
      el("td", Object.assign({ class: cls }, data), el("span", { class: "key", text: main }), detail ? el("span", { class: "detail muted", text: detail }) : "");
    const compared = !vs.reference && !nothing;
    const agree = vs.reference ? "reference" : nothing ? "–" : `${(vs.agree.share * 100).toFixed(1)}%`;
    const first = vs.reference ? "reference" : nothing ? "–" : vs.diverge < 0 ? "never" : `token ${vs.diverge}`;
    const name = el("th", { scope: "row", text: b });
    const price = servedPrice(b);
    if (price && !price.within_budget) {
      name.append(el("span", { class: "over-budget", title: priceText(price), text: budgetFlag(price) }));
    }
    const short = shortfallFlag(price);
    if (short) name.append(short);
    const long = longContextFlag(price);
    if (long) name.append(long);
    body.append(el("tr", { "data-backend": b },
      name,
      cell("bytes-ratio", sizeRatio(vs.peak), `${int(r.kv_bytes_per_token)} B/token`, { "data-ratio": String(vs.peak) }),
      cell("peak-ratio", sizeRatio(vs.peak), bytes(r.kv_peak_bytes), { "data-ratio": String(vs.peak) }),
      cell("ttft-ratio", timeRatio(vs.ttft), timingText(timings[b].ttft, TIMING_NONE.ttft), { "data-ratio": String(vs.ttft) }),
      cell("tpot-ratio", timeRatio(vs.tpot), timingText(timings[b].tpot, TIMING_NONE.tpot), { "data-ratio": String(vs.tpot) }),
      cell("agreement", agree, compared ? `${vs.agree.equal} of ${vs.agree.of} tokens` : nothing && !vs.reference ? "nothing to compare" : "",
           { "data-share": vs.reference ? "1" : nothing ? "" : String(vs.agree.share) }),
      cell("first-diff", first, "", { "data-index": vs.reference ? "reference" : nothing ? "" : String(vs.diverge) }),
      el("td", { class: "note", text: r.kv_uncompressed_reason ? `not compressed yet: ${r.kv_uncompressed_reason}`
                                                            : vs.peak < 1 ? "compressed" : "" })));
  }
  labelCells(table);
  $("#summary").hidden = false;
}

async function runCompare(ev) {
  if (ev) ev.preventDefault();
  const s = compareSettings();
  showError("");
  if (!info) { showError("The server is still loading its model; the page goes on by itself once it is ready."); return; }
  if (!s.prompt.trim()) { showError("Type a prompt first."); $("#prompt").focus(); return; }
  if (!s.backends.length) { showError("Choose at least one backend."); return; }
  history.replaceState(null, "", shareUrl(s));
  $("#copy-link").hidden = false;
  const cardsBox = $("#results");
  cardsBox.replaceChildren();
  $("#summary").hidden = true;
  $("#shown-prompt").hidden = true;
  $("#run").disabled = true;
  // the reference first, so that each card and row can be drawn against it as it arrives
  const order = s.backends.includes("full") ? ["full", ...s.backends.filter((b) => b !== "full")] : s.backends;
  const body = (backend, tokens) => JSON.stringify({ prompt: s.prompt, chat: s.chat, kv_backend: backend,
    max_new_tokens: tokens, repetition_penalty: s.repetition_penalty, seed: s.seed, temperature: s.temperature });
  const post = (backend, tokens) => api("/ui/api/generate", { method: "POST", headers: { "Content-Type": "application/json" },
                                                              body: body(backend, tokens) });
  const results = {}, timings = Object.fromEntries(order.map((b) => [b, { ttft: [], tpot: [] }]));
  try {
    for (const [i, backend] of order.entries()) {  // untimed: first-call costs stay out of the timings
      $("#compare-status").textContent = `warming up ${backend} (${i + 1}/${order.length}, untimed)…`;
      await post(backend, Math.min(WARM_TOKENS, s.max_new_tokens));
    }
    for (let run = 1; run <= s.runs; run++) {  // interleaved, so that a slow spell of the machine hits every backend
      for (const backend of order) {
        $("#compare-status").textContent = `run ${run}/${s.runs}: ${backend}…`;
        const result = await post(backend, s.max_new_tokens);
        timings[backend].ttft.push(result.ttft_s);
        timings[backend].tpot.push(result.tpot_s);
        if (run === 1) {
          results[backend] = result;
          if (backend === order[0]) {
            $("#shown-prompt-text").textContent = result.prompt_text;
            $("#shown-prompt-tokens").textContent = `${result.prompt_tokens} tokens` +
              (s.chat ? ", the prompt as a user turn through the model's chat template" : "");
            $("#shown-prompt").hidden = false;
          }
          cardsBox.append(renderCard(result, results[order[0]], timings[backend]));
        }
        refreshCards(order, results, timings);
        renderSummary(order, results, timings, s);
      }
    }
    $("#compare-status").textContent = `done: ${order.join(", ")}; ${s.runs} timed run${s.runs > 1 ? "s" : ""} each`;
  } catch (err) {
    showError(err.message);
    $("#compare-status").textContent = "";
  } finally {
    $("#run").disabled = false;
  }
}

// ---- Live -----------------------------------------------------------------------------------------------

async function pollLive() {
  if (!info) return;  // the server is still loading (see loadInfo)
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
  labelCells($("#live-table"));
  lastLive = now;
  $("#live-updated").textContent = "updated " + new Date().toLocaleTimeString();
  showError("");
}

// ---- Sums -----------------------------------------------------------------------------------------------

async function loadSums(ev) {
  if (ev) ev.preventDefault();
  if (!info) return;  // the server is still loading (see loadInfo)
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
    `at ${int(sums.seq_len)} tokens × ${int(sums.batch)} sequences: every backend this server knows at the ` +
    `estimator's defaults for the model, and each served backend's own settings. elastic's range runs from ` +
    `every compressible token quantized to every token exact.`;
  const warning = $("#sums-warning");
  warning.textContent = (sums.warnings || []).join(" ");
  warning.hidden = !warning.textContent;
  const body = $("#sums-table tbody");
  body.replaceChildren();
  for (const r of sums.rows) {
    const params = Object.entries(r.params).map(([k, v]) => `${k}=${v}`).join(", ") || "-";
    const ranged = r.min_total_bytes !== undefined;  // elastic: from all quantized to all exact
    const perLayer = ranged ? `${int(r.min_bytes_per_token_per_layer)}–${int(r.bytes_per_token_per_layer)}`
                            : int(r.bytes_per_token_per_layer);
    const perToken = ranged ? `${int(r.min_bytes_per_token_per_layer * sums.num_layers)}–${int(r.bytes_per_token)}`
                            : int(r.bytes_per_token);
    const total = ranged ? `${bytes(r.min_total_bytes)}–${bytes(r.total_bytes)}` : bytes(r.total_bytes);
    const fullPer = r.vs_full ? r.bytes_per_token_per_layer * r.vs_full : null;
    const vs = ranged && fullPer ? `${sizeRatio(1)} to ${sizeRatio(r.min_bytes_per_token_per_layer / fullPer)}`
                                 : r.vs_full ? sizeRatio(1 / r.vs_full) : "–";
    const priceCell = el("td", { class: r.price && !r.price.within_budget ? "price over-budget-price" : "price",
                                 "data-price": r.price ? String(r.price.ppl_increase_pct) : "",
                                 "data-agreement": r.price ? String(r.price.agreement) : "", text: priceText(r.price) });
    const short = shortfallFlag(r.price);
    if (short) priceCell.append(short);
    const long = longContextFlag(r.price);
    if (long) priceCell.append(long);
    body.append(el("tr", { "data-backend": r.backend, "data-aka": r.aka || "" },
      el("th", { scope: "row", text: r.aka ? `${r.backend} (${r.aka})` : r.backend }),
      el("td", { class: "params", text: params }),
      el("td", { text: perLayer }), el("td", { text: perToken }),
      el("td", { class: "total", text: total }),
      el("td", { class: "vs-full", text: vs }),
      el("td", { class: "served", text: r.served_as.join(", ") || "–" }),
      priceCell));
  }
  labelCells($("#sums-table"));
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
  $("#preset").addEventListener("change", (ev) => {
    if (ev.target.value) $("#prompt").value = ev.target.value;
    ev.target.value = "";
  });
  const q = new URLSearchParams(location.search);
  if (q.has("seq_len")) $("#seq-len").value = q.get("seq_len");
  if (q.has("batch")) $("#batch").value = q.get("batch");
  if (q.has("view")) selectView(q.get("view"));
  if (!(await loadInfo())) return;
  $("#model").textContent = `${info.model_id} · ${info.model_dtype} on ${info.model_device_type} · default backend ${info.kv_backend}`;
  try {
    defaults = await api("/ui/api/defaults");
  } catch (err) {
    showError(err.message);
    return;
  }
  renderDefaults();
  renderBackends();
  $("#run").disabled = false;
  const run = applyQuery();
  selectView(q.get("view") || "compare");  // again: Live and Sums wait for /info
  if (run && (q.get("view") || "compare") === "compare") runCompare();
}

// /info once the model is loaded and calibrated: while the server answers 503 (loading, calibrating) or cannot
// be reached, poll /health and try again, saying so on the page. False on any other error (shown).
async function loadInfo() {
  const notice = $("#waiting");
  for (;;) {
    try {
      info = await api("/info");
      notice.hidden = true;
      return true;
    } catch (err) {
      if (err.status !== null && err.status !== 503) { showError(err.message); return false; }
      notice.textContent = `${err.message}. Waiting for the server: checking /health every 2 s; the page goes on by itself.`;
      notice.hidden = false;
      if (!(await waitForHealth(notice))) return false;
    }
  }
}

async function waitForHealth(notice) {
  for (;;) {
    await sleep(2000);
    try {
      await api("/health");
      return true;
    } catch (err) {
      if (err.status !== null && err.status !== 503) { showError(err.message); return false; }
      notice.textContent = `${err.message}. Waiting for the server: checking /health every 2 s; the page goes on by itself ` +
        `(last checked ${new Date().toLocaleTimeString()}).`;
    }
  }
}

document.addEventListener("DOMContentLoaded", start);
