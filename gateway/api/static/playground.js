// The chat playground: one streamed chat completion at a time, rendered as text (textContent, never
// parsed as markup), stoppable with an AbortController (the gateway sees the connection close and frees the
// request's KV cache), with per-answer timings and token counts from the stream's usage chunk.
// With tools, the answer's tool calls are shown as they stream (name, then the arguments growing); while
// calls wait for results, what you send is the next call's result (role "tool"), and the model is asked again
// once every call has one.
import { $, ApiError, KEY_STORE, apiError, bindSecret, countdown, describe, el, fmtInt, fmtNum, getJSON,
  secrets } from "/assets/common.js";
import { sseEvents } from "/assets/sse.js";

const history = []; // {role, content, tool_calls?, tool_call_id?, stats?}: the context sent back, and Export
const pending = []; // tool calls of the last answer still waiting for their result: {id, name}
let current = null; // the answer being streamed: {controller, ...}
let cancelCountdown = () => {};
let retryLocked = false; // a 429/503 countdown is running: Send waits for it

function showError(text) {
  cancelCountdown();
  retryLocked = false;
  $("error").hidden = !text;
  $("error").textContent = text || "";
}

function showApiError(err) {
  const text = describe(err);
  if (err instanceof ApiError && err.retryAfter !== null && (err.status === 429 || err.status === 503)) {
    $("error").hidden = false;
    cancelCountdown();
    retryLocked = true; // sending again before the gateway said so only earns another refusal
    setBusy(current !== null);
    cancelCountdown = countdown($("error"), text, err.retryAfter, () => {
      retryLocked = false;
      setBusy(current !== null);
    });
    return;
  }
  showError(text);
}

async function loadModels(key) {
  const select = $("model");
  select.replaceChildren();
  if (!key) return;
  try {
    const body = await getJSON("/v1/models", key);
    for (const m of body.data) select.append(el("option", { value: m.id }, m.id));
    showError("");
  } catch (err) {
    showApiError(err);
  }
}

// Sampling fields: blank means "the server's default"; anything typed must be a number.
function samplingParams() {
  const out = {};
  for (const [id, integer] of [["temperature", false], ["top_p", false], ["max_tokens", true], ["seed", true]]) {
    const raw = $(id).value.trim();
    if (raw === "") continue;
    const value = Number(raw);
    if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
      throw new Error(`${id} must be ${integer ? "a whole number" : "a number"}`);
    }
    out[id] = value;
  }
  return out;
}

// Keeps the newest text in view while it streams, unless the reader scrolled up to read something earlier.
function followingBottom(update) {
  const box = $("conversation");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  update();
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function addMessage(role, label, text) {
  const body = el("div", { class: "text" }, text);
  const stats = el("div", { class: "stats" });
  const node = el("article", { class: `msg ${role}` }, el("div", { class: "role" }, label), body, stats);
  $("conversation").append(node);
  $("conversation").scrollTop = $("conversation").scrollHeight; // a new message always comes into view
  return { node, body, stats };
}

function requestBody(model) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of history) {
    const msg = { role: m.role, content: m.content };
    if (m.tool_calls) msg.tool_calls = m.tool_calls;
    if (m.tool_call_id) msg.tool_call_id = m.tool_call_id;
    messages.push(msg);
  }
  return { model, messages, stream: true, stream_options: { include_usage: true }, ...samplingParams(),
    ...toolParams() };
}

// Blank: no tools. Anything typed must be a JSON array; the gateway checks the rest (a 400 is shown as is).
function toolParams() {
  const raw = $("tools").value.trim();
  if (!raw) return {};
  let tools;
  try {
    tools = JSON.parse(raw);
  } catch {
    throw new Error("Tools must be a JSON array");
  }
  if (!Array.isArray(tools)) throw new Error("Tools must be a JSON array");
  return { tools, tool_choice: $("tool_choice").value };
}

async function send() {
  const key = secrets.get(KEY_STORE);
  const text = $("prompt").value;
  if (current !== null || retryLocked || !text.trim()) return;
  if (!key) return showError("Paste an API key above first.");
  const model = $("model").value;
  if (!model) return showError("No model: use a valid key so the model list can load.");
  let body;
  const call = pending.length ? pending[0] : null; // with calls waiting, this text is the first one's result
  try {
    history.push(call ? { role: "tool", content: text, tool_call_id: call.id } : { role: "user", content: text });
    body = requestBody(model);
  } catch (err) {
    history.pop();
    return showError(err.message);
  }
  showError("");
  $("prompt").value = "";
  if (call) {
    pending.shift();
    showPending();
    addMessage("tool", `result of ${call.name}`, text);
    if (pending.length) return; // more calls wait: the model is asked once all have results
  } else {
    addMessage("user", "you", text);
  }
  const view = addMessage("assistant", model, "");
  await stream(key, body, view);
}

function showPending() {
  $("prompt").placeholder = pending.length
    ? `Result of ${pending[0].name} (sent as a tool message)` : "Ask something (Ctrl+Enter sends)";
}

async function stream(key, body, view) {
  const answer = { controller: new AbortController(), text: "", calls: [], started: performance.now(), first: null,
    chunks: 0, usage: null, finish: null, ended: null };
  current = answer;
  setBusy(true);
  view.node.dataset.state = "waiting";
  view.stats.textContent = "waiting for the first token…";
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", signal: answer.controller.signal,
      headers: { Authorization: `Bearer ${key}`, "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (!res.ok) throw await apiError(res);
    await readAnswer(res, answer, view);
  } catch (err) {
    fail(answer, view, err);
  } finally {
    answer.ended = answer.ended ?? performance.now();
    finish(answer, view);
  }
}

async function readAnswer(res, answer, view) {
  for await (const event of sseEvents(res)) {
    if (event.data === "[DONE]") return (view.node.dataset.state = "done");
    const chunk = JSON.parse(event.data);
    if (chunk.error) throw new StreamError(chunk.error);
    if (chunk.usage) answer.usage = chunk.usage;
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) continue;
    if (choice.finish_reason) answer.finish = choice.finish_reason;
    const delta = choice.delta || {};
    if (!delta.content && !delta.tool_calls) continue;
    answer.first = answer.first ?? performance.now();
    answer.chunks += 1;
    answer.text += delta.content || "";
    for (const tc of delta.tool_calls || []) addCallDelta(answer.calls, tc);
    followingBottom(() => {
      view.body.textContent = answer.text; // text, never markup
      for (const c of answer.calls) view.body.append(el("div", { class: "toolcall" }, `→ ${c.function.name}(${c.function.arguments})`));
      view.node.dataset.state = "streaming";
      view.stats.textContent = `streaming… ${answer.chunks} chunks`;
    });
  }
  throw new Error("the stream ended before [DONE] (connection lost)");
}

// OpenAI's streamed tool calls: the first delta of a call has its index, id and name; later ones add arguments.
function addCallDelta(calls, tc) {
  const call = (calls[tc.index] ??= { id: tc.id, type: "function", function: { name: "", arguments: "" } });
  if (tc.id) call.id = tc.id;
  if (tc.function && tc.function.name) call.function.name = tc.function.name;
  if (tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
}

class StreamError extends Error {
  constructor(error) {
    super(String(error.message ?? "unknown error"));
    this.code = error.code ?? null;
  }
}

function fail(answer, view, err) {
  answer.ended = performance.now();
  if (err.name === "AbortError") {
    view.node.dataset.state = "stopped";
    return;
  }
  view.node.dataset.state = "error";
  if (err instanceof StreamError) showError(`The stream ended with an error: ${err.message}${err.code ? ` [${err.code}]` : ""}`);
  else if (err instanceof ApiError) showApiError(err);
  else showError(describe(err));
}

function answerStats(a) {
  const u = a.usage;
  const ttft = a.first === null ? null : a.first - a.started;
  const completion = u ? u.completion_tokens : a.chunks;
  // Decode speed: the tokens after the first over the time after the first (TTFT is shown apart).
  const decodeS = a.first === null ? 0 : (a.ended - a.first) / 1000;
  const rate = decodeS > 0 && completion > 1 ? (completion - 1) / decodeS : null;
  const cached = u && u.prompt_tokens_details ? u.prompt_tokens_details.cached_tokens : null;
  return { ttft_ms: ttft, tokens_per_s: rate, prompt_tokens: u ? u.prompt_tokens : null, cached_tokens: cached,
    completion_tokens: u ? u.completion_tokens : null, finish_reason: a.finish };
}

function finish(answer, view) {
  const stats = answerStats(answer);
  stats.state = view.node.dataset.state;
  const parts = [`TTFT ${stats.ttft_ms === null ? "–" : `${Math.round(stats.ttft_ms)} ms`}`,
    `${fmtNum(stats.tokens_per_s)} tok/s`, `prompt ${fmtInt(stats.prompt_tokens)}`,
    `cached ${fmtInt(stats.cached_tokens)}`, `completion ${fmtInt(stats.completion_tokens)}`];
  if (stats.state === "stopped") parts.push("stopped");
  else if (stats.finish_reason) parts.push(`finish: ${stats.finish_reason}`);
  followingBottom(() => { view.stats.textContent = parts.join(" · "); });
  if (answer.calls.length && stats.state === "done") {
    history.push({ role: "assistant", content: answer.text || null, tool_calls: answer.calls, stats });
    pending.splice(0, pending.length, ...answer.calls.map((c) => ({ id: c.id, name: c.function.name })));
    showPending();
  } else if (answer.text || stats.state === "done") {
    history.push({ role: "assistant", content: answer.text, stats });
  } else if (stats.state === "error" && history.length && history[history.length - 1].role === "user") {
    // Nothing came back: the question goes back in the box for a retry instead of staying in the context.
    const asked = history.pop();
    if (!$("prompt").value) $("prompt").value = asked.content;
  }
  current = null;
  setBusy(false);
}

function setBusy(busy) {
  $("send").disabled = busy || retryLocked;
  $("stop").disabled = !busy;
}

function exportConversation() {
  const data = { exported_at: new Date().toISOString(), model: $("model").value, system: $("system").value,
    params: safeParams(), messages: history };
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  const link = el("a", { href: url, download: `kvgate-conversation-${Date.now()}.json` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

function safeParams() {
  try {
    return samplingParams();
  } catch {
    return {};
  }
}

function start() {
  bindSecret({ store: KEY_STORE, input: $("key"), use: $("use-key"), forget: $("forget-key"),
    state: $("key-state"), onChange: loadModels });
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => current && current.controller.abort());
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send();
  });
  $("export").addEventListener("click", exportConversation);
  $("clear").addEventListener("click", () => {
    if (current !== null) current.controller.abort();
    history.length = 0;
    pending.length = 0;
    showPending();
    $("conversation").replaceChildren();
    showError("");
  });
}

start();
