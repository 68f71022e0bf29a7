// quill serve's page: write with the model (streamed from /v1/completions) and draw the
// attention of a prompt (from /v1/attention). Plain JS, no build step, no network beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("quill-key") || "", model: null, controller: null, attn: null, focus: [0, 0] };

// --- talking to the server ------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

async function errorText(response) {
  try { return (await response.json()).error.message; } catch (e) { return response.status + " " + response.statusText; }
}

async function connect() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    $("key-form").hidden = false;
    $("model-info").textContent = "this server needs an API key";
    return;
  }
  if (!response.ok) { $("model-info").textContent = await errorText(response); return; }
  const model = (await response.json()).data[0];
  state.model = model;
  $("key-form").hidden = true;
  $("model-info").textContent = `${model.id} · ${model.n_layer} layers × ${model.n_head} heads · ` +
    `context ${model.block_size} · step ${model.step}`;
  const max = $("max-tokens");
  max.max = Math.min(model.max_tokens, 2000);
  if (+max.value > +max.max) { max.value = max.max; showValue("max-tokens"); }
}

// Server-Sent Events from a fetch body: yields each `data:` payload ("[DONE]" included).
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

// --- Write tab ------------------------------------------------------------------------------

function showValue(id) { $(id + "-out").textContent = $(id).value; }

function setRunning(running) {
  $("generate").disabled = running;
  $("stop").disabled = !running;
}

function setStatus(el, text, isError) {
  el.textContent = text;
  el.classList.toggle("error", !!isError);
}

async function generate() {
  const prompt = $("prompt").value;
  const body = {
    prompt, max_tokens: +$("max-tokens").value, temperature: +$("temperature").value,
    top_p: +$("top-p").value, stream: true, stream_options: { include_usage: true },
  };
  if (state.model) body.model = state.model.id;
  if ($("seed").value !== "") body.seed = +$("seed").value;
  $("out-prompt").textContent = prompt;
  $("out-gen").textContent = "";
  setStatus($("stats"), "waiting for the first token…");
  state.controller = new AbortController();
  setRunning(true);
  const t0 = performance.now();
  let first = null, pieces = 0, finish = null, usage = null;
  const show = () => {
    const now = performance.now(), tokens = usage ? usage.completion_tokens : pieces;
    const rate = first !== null && now > first ? (tokens - 1) / ((now - first) / 1000) : 0;
    setStatus($("stats"), `${tokens} tokens · ${rate.toFixed(1)} tokens/s · first token ${first === null ? "–" : (first - t0).toFixed(0) + " ms"}` +
      (finish ? ` · finished: ${finish}` : ""));
  };
  try {
    const response = await fetch("/v1/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal });
    if (!response.ok) { setStatus($("stats"), await errorText(response), true); if (response.status === 401) connect(); return; }
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) { setStatus($("stats"), chunk.error.message, true); return; }
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices) {
        if (choice.text) {
          if (first === null) first = performance.now();
          $("out-gen").textContent += choice.text;
        }
        pieces += 1;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      show();
    }
    show();
  } catch (e) {
    if (e.name === "AbortError") { finish = "stopped"; show(); } else setStatus($("stats"), String(e), true);
  } finally {
    setRunning(false);
    state.controller = null;
    $("attn-run-all").disabled = !$("out-gen").textContent;
  }
}

// --- Attention tab --------------------------------------------------------------------------

// A perceptually ordered colour map (viridis, 5 stops), weight 0..1 → rgb.
const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function colour(w) {
  const x = Math.max(0, Math.min(1, Math.sqrt(w))) * (STOPS.length - 1);  // sqrt: small weights stay visible
  const i = Math.min(STOPS.length - 2, Math.floor(x)), f = x - i, a = STOPS[i], b = STOPS[i + 1];
  return `rgb(${a.map((v, k) => Math.round(v + f * (b[k] - v))).join(",")})`;
}

const GRID = { pad: 26, gap: 8 };

// The colour scale: weight 0 at the bottom to 1 at the top, ticks where the sqrt puts them.
function drawScale() {
  const canvas = $("attn-scale"), ctx = canvas.getContext("2d"), x0 = 6, w = 16, y0 = 10, h = canvas.height - 20;
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (let y = 0; y < h; y++) {
    ctx.fillStyle = colour(((h - 1 - y) / (h - 1)) ** 2);  // colour() takes sqrt: this row's position is linear in it
    ctx.fillRect(x0, y0 + y, w, 1);
  }
  ctx.fillStyle = "#1d2330";
  ctx.font = "11px system-ui, sans-serif";
  for (const t of [0, 0.05, 0.25, 0.5, 1]) {
    const y = y0 + (h - 1) * (1 - Math.sqrt(t));
    ctx.fillRect(x0 + w, y, 4, 1);
    ctx.fillText(String(t), x0 + w + 7, y + 4);
  }
}

function drawMap(ctx, weights, x0, y0, cell) {
  const T = weights.length;
  for (let q = 0; q < T; q++) for (let k = 0; k < T; k++) {
    ctx.fillStyle = k > q ? "#f2f4f7" : colour(weights[q][k]);  // k > q: the future, never attended
    ctx.fillRect(x0 + k * cell, y0 + q * cell, cell, cell);
  }
}

function drawGrid() {
  const a = state.attn, T = a.tokens.length, canvas = $("attn-grid");
  const width = Math.min(560, document.body.clientWidth - 60);  // the enlarged map goes beside it
  const cell = Math.max(1, Math.min(10, Math.floor((width - GRID.pad - GRID.gap * a.n_head) / (a.n_head * T))));
  const size = cell * T;
  canvas.width = GRID.pad + a.n_head * (size + GRID.gap);
  canvas.height = GRID.pad + a.n_layer * (size + GRID.gap);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.fillStyle = "#667085";
  ctx.font = "11px system-ui, sans-serif";
  for (let h = 0; h < a.n_head; h++) ctx.fillText("H" + h, GRID.pad + h * (size + GRID.gap), 16);
  for (let l = 0; l < a.n_layer; l++) {
    ctx.fillStyle = "#667085";
    ctx.fillText("L" + l, 2, GRID.pad + l * (size + GRID.gap) + 12);
    for (let h = 0; h < a.n_head; h++) drawMap(ctx, a.weights[l][h], GRID.pad + h * (size + GRID.gap), GRID.pad + l * (size + GRID.gap), cell);
  }
  state.grid = { cell, size };
}

function drawFocus() {
  const a = state.attn, [l, h] = state.focus, T = a.tokens.length, canvas = $("attn-focus");
  const cell = Math.max(8, Math.min(28, Math.floor(520 / T)));
  const ctx = canvas.getContext("2d");
  const font = `${Math.min(12, cell)}px ui-monospace, monospace`;
  ctx.font = font;
  const label = 10 + Math.max(...a.tokens.map((t) => ctx.measureText(t).width));  // room for the longest token
  canvas.width = label + T * cell + 10;
  canvas.height = label + T * cell + 10;
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  drawMap(ctx, a.weights[l][h], label, label, cell);
  ctx.fillStyle = "#1d2330";
  ctx.font = font;  // resizing the canvas reset it
  ctx.textAlign = "right";
  a.tokens.forEach((t, i) => ctx.fillText(t, label - 4, label + i * cell + cell * 0.75));
  ctx.save();
  ctx.textAlign = "left";
  a.tokens.forEach((t, i) => {
    ctx.setTransform(1, 0, 0, 1, label + i * cell + cell * 0.75, label - 4);
    ctx.rotate(-Math.PI / 2);
    ctx.fillText(t, 0, 0);
  });
  ctx.restore();
  $("focus-title").textContent = `layer ${l}, head ${h}: tokens down, what each attends to across`;
  state.focusCell = { cell, label };
}

// Canvas position → [layer, head, query, key], or null outside every map.
function gridCell(x, y) {
  const { cell, size } = state.grid, a = state.attn, step = size + GRID.gap;
  const h = Math.floor((x - GRID.pad) / step), l = Math.floor((y - GRID.pad) / step);
  const k = Math.floor((x - GRID.pad - h * step) / cell), q = Math.floor((y - GRID.pad - l * step) / cell);
  if (x < GRID.pad || y < GRID.pad || h >= a.n_head || l >= a.n_layer || k >= a.tokens.length || q >= a.tokens.length) return null;
  return [l, h, q, k];
}

function focusCell(x, y) {
  const { cell, label } = state.focusCell, T = state.attn.tokens.length;
  const k = Math.floor((x - label) / cell), q = Math.floor((y - label) / cell);
  return x < label || y < label || k >= T || q >= T ? null : [state.focus[0], state.focus[1], q, k];
}

function showTip(event, where) {
  const tip = $("tip");
  if (!where) { tip.hidden = true; return; }
  const [l, h, q, k] = where, a = state.attn;
  const weight = k > q ? "masked (future token)" : a.weights[l][h][q][k].toFixed(4);
  tip.textContent = `layer ${l} head ${h}\n${JSON.stringify(a.tokens[q])} (#${q}) → ${JSON.stringify(a.tokens[k])} (#${k})\nweight ${weight}`;
  tip.style.left = event.clientX + 14 + "px";
  tip.style.top = event.clientY + 14 + "px";
  tip.hidden = false;
}

function canvasXY(event) {
  const r = event.target.getBoundingClientRect();
  return [(event.clientX - r.left) * event.target.width / r.width, (event.clientY - r.top) * event.target.height / r.height];
}

// The prompt of the Write tab, or (withContinuation) the prompt it generated from and the text it generated.
async function showAttention(withContinuation) {
  const status = $("attn-status");
  const text = withContinuation ? $("out-prompt").textContent + $("out-gen").textContent : $("prompt").value;
  setStatus(status, withContinuation ? "running the prompt and its continuation…" : "running the prompt…");
  $("attn-run").disabled = $("attn-run-all").disabled = true;
  try {
    const body = { prompt: text };
    if (state.model) body.model = state.model.id;
    const response = await fetch("/v1/attention", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!response.ok) { setStatus(status, await errorText(response), true); return; }
    state.attn = await response.json();
    // the button of what is shown is the highlighted one (it was always the prompt's)
    $("attn-run").classList.toggle("primary", !withContinuation);
    $("attn-run-all").classList.toggle("primary", withContinuation);
    $("attn-run").setAttribute("aria-pressed", String(!withContinuation));
    $("attn-run-all").setAttribute("aria-pressed", String(withContinuation));
    state.focus = [state.attn.n_layer - 1, 0];
    drawGrid();
    drawFocus();
    const a = state.attn;
    setStatus(status, `${a.tokens.length} tokens${withContinuation ? " of the prompt and its continuation" : ""}, ` +
      `${a.n_layer} layers × ${a.n_head} heads` + (a.cropped ? ` (the first ${a.cropped} tokens were cropped)` : ""));
  } catch (e) {
    setStatus(status, String(e), true);
  } finally {
    $("attn-run").disabled = false;
    $("attn-run-all").disabled = !$("out-gen").textContent;
  }
}

// --- wiring ---------------------------------------------------------------------------------

function openTab(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.tab === name);
  $("panel-write").hidden = name !== "write";
  $("panel-attention").hidden = name !== "attention";
  if (name === "attention" && !state.attn) showAttention(false);
}

for (const id of ["temperature", "top-p", "max-tokens"]) $(id).addEventListener("input", () => showValue(id));
for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => openTab(tab.dataset.tab));
$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate(); });
$("attn-run").addEventListener("click", () => showAttention(false));
$("attn-run-all").addEventListener("click", () => showAttention(true));
$("prompt").addEventListener("input", () => { state.attn = null; });  // the Attention tab redraws for the new prompt
$("attn-grid").addEventListener("mousemove", (e) => state.attn && showTip(e, gridCell(...canvasXY(e))));
$("attn-grid").addEventListener("mouseleave", () => { $("tip").hidden = true; });
$("attn-grid").addEventListener("click", (e) => {
  const where = state.attn && gridCell(...canvasXY(e));
  if (where) { state.focus = [where[0], where[1]]; drawFocus(); }
});
$("attn-focus").addEventListener("mousemove", (e) => state.attn && showTip(e, focusCell(...canvasXY(e))));
$("attn-focus").addEventListener("mouseleave", () => { $("tip").hidden = true; });
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = $("key").value.trim();
  sessionStorage.setItem("quill-key", state.key);
  drawScale();
connect();
});
drawScale();
connect();
