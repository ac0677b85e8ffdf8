// splitserve's web page: a chat playground and a live cluster view (server/ui.py).
// Plain JavaScript, no dependencies; every text from the server is set with textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "splitserve.apiKey";
const state = { history: [], abort: null, clusterTimer: null, operator: false };

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- views ----------------------------------------------------------------------------------
function show(view) {
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.view === view);
  $("view-chat").hidden = view !== "chat";
  $("view-cluster").hidden = view !== "cluster";
  if (view === "cluster") startCluster(); else stopCluster();
}

// ---- chat -----------------------------------------------------------------------------------
function addMessage(role, text) {
  const box = el("div", "msg " + role, text);
  $("messages").appendChild(box);
  $("messages").scrollTop = $("messages").scrollHeight;
  return box;
}

function readJSON(id, what) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try { return JSON.parse(text); } catch (e) { throw new Error(what + " is not valid JSON: " + e.message); }
}

function requestBody(messages) {
  const body = {
    model: "default", messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  const schema = readJSON("schema", "the JSON schema");
  if (schema !== undefined) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
  }
  const tools = readJSON("tools", "the tools");
  if (tools !== undefined) body.tools = tools;
  return body;
}

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function formatStats(s) {
  const parts = [];
  if (s.ttft !== undefined) parts.push(["TTFT", s.ttft.toFixed(0) + " ms"]);
  if (s.total !== undefined) parts.push(["total", s.total.toFixed(0) + " ms"]);
  if (s.usage) {
    parts.push(["prompt", s.usage.prompt_tokens], ["completion", s.usage.completion_tokens]);
    const cached = (s.usage.prompt_tokens_details || {}).cached_tokens;
    parts.push(["cached", cached === undefined ? 0 : cached]);
  }
  if (s.constraint) parts.push(["constraint", s.constraint]);
  if (s.stages) {
    parts.push(["stages", Object.entries(s.stages).map(([k, v]) => k + " " + v.toFixed(1)).join(", ") + " ms"]);
  }
  const stats = $("answer-stats");
  stats.textContent = "";
  for (const [name, value] of parts) {
    stats.appendChild(document.createTextNode(name + " "));
    stats.appendChild(el("b", "", String(value)));
    stats.appendChild(document.createTextNode("   "));
  }
}

async function send(event) {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || state.abort) return;
  $("settings-error").textContent = "";
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  let body;
  try { body = requestBody(messages); } catch (e) { $("settings-error").textContent = e.message; return; }
  $("chat-input").value = "";
  addMessage("user", text);
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const calls = {};
  const stats = {};
  const started = performance.now();
  state.abort = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  let answer = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: { ...headers(true), "x-splitserve-timing": "1" },
      body: JSON.stringify(body), signal: state.abort.signal,
    });
    stats.constraint = response.headers.get("x-splitserve-constraint") || undefined;
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || response.statusText);
    }
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) stats.usage = chunk.usage;
      if (chunk.splitserve_timing) stats.stages = chunk.splitserve_timing.stages_ms;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.content) {
          if (stats.ttft === undefined) stats.ttft = performance.now() - started;
          answer += delta.content;
          box.textContent = answer;
        }
        for (const call of delta.tool_calls || []) {
          if (stats.ttft === undefined) stats.ttft = performance.now() - started;
          const c = calls[call.index] || (calls[call.index] = { name: "", arguments: "" });
          if (call.function && call.function.name) c.name += call.function.name;
          if (call.function && call.function.arguments) c.arguments += call.function.arguments;
        }
      }
      if (Object.keys(calls).length) {
        box.textContent = answer;
        for (const c of Object.values(calls)) box.appendChild(el("div", "calls", c.name + "(" + c.arguments + ")"));
      }
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    stats.total = performance.now() - started;
    state.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
  } catch (e) {
    if (e.name !== "AbortError") { box.classList.add("error"); box.textContent = (answer ? answer + "\n" : "") + "Error: " + e.message; }
  } finally {
    box.classList.remove("streaming");
    box.classList.add("done");
    state.abort = null;
    $("send").disabled = false; $("stop").disabled = true;
    formatStats(stats);
  }
}

// ---- cluster --------------------------------------------------------------------------------
function fmt(x, digits) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); }

function workerCard(w) {
  const card = el("div", "worker");
  card.dataset.workerId = w.worker_id;
  const h = el("h3");
  h.appendChild(el("span", "role " + w.role, w.role));
  h.appendChild(el("span", "", w.worker_id));
  const status = !w.healthy ? "down" : w.draining ? "draining" : "healthy";
  h.appendChild(el("span", "state " + status, status));
  card.appendChild(h);
  const used = w.pages_total ? w.pages_used / w.pages_total : 0;
  const bar = el("div", "bar"); const fill = el("span"); fill.style.width = (100 * used).toFixed(1) + "%"; bar.appendChild(fill);
  card.appendChild(bar);
  const dl = el("dl");
  const rows = [
    ["KV pages", w.pages_used + " / " + w.pages_total],
    ["running / waiting", w.num_running + " / " + w.num_waiting],
    ["in flight (router)", w.in_flight],
    ["transfers in flight", w.num_transferring],
    ["cache hit rate", w.cache_hit_rate === null ? "–" : (100 * w.cache_hit_rate).toFixed(1) + " %"],
    ["tokens/s", fmt(w.tokens_per_s, 1)],
    ["KV transfer", fmt(w.kv_mb_per_s, 2) + " MB/s"],
  ];
  for (const [k, v] of rows) { dl.appendChild(el("dt", "", k)); dl.appendChild(el("dd", "", String(v))); }
  card.appendChild(dl);
  if (state.operator) {
    const b = el("button", "drain", w.draining ? "Resume" : "Drain");
    b.addEventListener("click", () => setDraining(w.worker_id, !w.draining));
    card.appendChild(b);
  }
  return card;
}

async function setDraining(id, drain) {
  const r = await fetch("/workers/" + encodeURIComponent(id) + (drain ? "/drain" : "/resume"),
                        { method: "POST", headers: headers(true), body: "{}" });
  if (!r.ok) $("cluster-status").textContent = "drain failed: HTTP " + r.status;
  refreshCluster();
}

function plot(canvas, points, series) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 4;
  ctx.clearRect(0, 0, w, h);
  const values = points.flatMap((p) => series.map((s) => p[s.key])).filter((v) => v !== null && v !== undefined);
  const max = Math.max(1e-9, ...values) * 1.1;
  ctx.strokeStyle = "#dde1e8"; ctx.lineWidth = 1;
  ctx.beginPath(); ctx.moveTo(0, h - pad); ctx.lineTo(w, h - pad); ctx.stroke();
  ctx.fillStyle = "#6b7385"; ctx.font = "11px system-ui";
  ctx.fillText(max.toPrecision(3), 4, 12);
  const n = points.length;
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.lineWidth = 2; ctx.beginPath();
    let drawing = false;
    points.forEach((p, i) => {
      const v = p[s.key];
      if (v === null || v === undefined) { drawing = false; return; }
      const x = n <= 1 ? w : (i / (n - 1)) * w, y = h - pad - (v / max) * (h - 2 * pad);
      if (drawing) ctx.lineTo(x, y); else { ctx.moveTo(x, y); drawing = true; }
    });
    ctx.stroke();
    ctx.fillStyle = s.color;
    points.forEach((p, i) => {  // a dot per interval, so a lone value shows too
      const v = p[s.key];
      if (v === null || v === undefined) return;
      const x = n <= 1 ? w - 2 : (i / (n - 1)) * (w - 4) + 2, y = h - pad - (v / max) * (h - 2 * pad);
      ctx.fillRect(x - 1.5, y - 1.5, 3, 3);
    });
  }
}

async function refreshCluster() {
  let data;
  try {
    const r = await fetch("/cluster", { headers: headers(false) });
    if (!r.ok) throw new Error("HTTP " + r.status + (r.status === 401 ? ": enter the API key above" : ""));
    data = await r.json();
  } catch (e) { $("cluster-status").textContent = "cluster view unavailable: " + e.message; return; }
  state.operator = data.operator;
  $("model").textContent = data.model;
  const healthy = data.workers.filter((w) => w.healthy).length;
  $("cluster-status").textContent = data.workers.length + " workers, " + healthy + " healthy; updated " +
    new Date(data.time * 1000).toLocaleTimeString() + (data.operator ? "" : " (drain needs the operator key)");
  const box = $("workers");
  box.textContent = "";
  for (const w of data.workers) box.appendChild(workerCard(w));
  const hist = data.history;
  const A = "#2f6fdf", B = "#e08a2c";
  plot($("plot-ttft"), hist, [{ key: "ttft_p90_s", color: A }, { key: "ttft_mean_s", color: B }]);
  plot($("plot-itl"), hist, [{ key: "itl_p90_s", color: A }, { key: "itl_mean_s", color: B }]);
  plot($("plot-tokens"), hist, [{ key: "tokens_per_s", color: A }]);
  plot($("plot-requests"), hist, [{ key: "requests_per_s", color: A }]);
}

function startCluster() {
  if (state.clusterTimer) return;
  refreshCluster();
  state.clusterTimer = setInterval(refreshCluster, 2000);
}

function stopCluster() { clearInterval(state.clusterTimer); state.clusterTimer = null; }

// ---- start ----------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => localStorage.setItem(KEY_STORE, $("api-key").value.trim()));
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => show(b.dataset.view));
  $("chat-form").addEventListener("submit", send);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("clear").addEventListener("click", () => { state.history = []; $("messages").textContent = ""; $("answer-stats").textContent = ""; });
  show(location.hash === "#cluster" ? "cluster" : "chat");
});
