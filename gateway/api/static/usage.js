// The key's own tenant usage from /v1/usage (the gateway never shows another tenant's): tokens per UTC day and
// per model, each as a stacked SVG chart with the exact figures in a table beside it.
import { $, KEY_STORE, bindSecret, describe, el, fmtInt, getJSON, secrets } from "/assets/common.js";
import { legend, stackedBars } from "/assets/chart.js";

const SERIES = [
  { key: "uncached", label: "prompt (computed)" },
  { key: "cached_tokens", label: "prompt (cached)" },
  { key: "completion_tokens", label: "completion" },
];
const COLUMNS = [["requests", "requests"], ["prompt_tokens", "prompt"], ["cached_tokens", "cached"],
  ["completion_tokens", "completion"], ["total_tokens", "total"]];
const MAX_FILLED_DAYS = 92;

function withUncached(row) {
  return { ...row, uncached: Math.max(0, row.prompt_tokens - row.cached_tokens) };
}

// Every UTC day from `since` to today, so quiet days show as gaps rather than vanish from the axis.
function fillDays(rows, since) {
  const byDay = new Map(rows.map((r) => [r.group, r]));
  const days = [];
  const today = new Date().toISOString().slice(0, 10);
  const d = new Date(Math.floor(since / 86400) * 86400 * 1000);
  while (days.length < MAX_FILLED_DAYS) {
    const day = d.toISOString().slice(0, 10);
    days.push(byDay.get(day) || { group: day, requests: 0, prompt_tokens: 0, cached_tokens: 0, completion_tokens: 0, total_tokens: 0 });
    if (day >= today) break;
    d.setUTCDate(d.getUTCDate() + 1);
  }
  return days;
}

function table(node, heading, rows) {
  const head = el("tr", {}, el("th", { scope: "col" }, heading), ...COLUMNS.map(([, label]) => el("th", { scope: "col" }, label)));
  const body = rows.filter((r) => r.requests > 0).map((r) =>
    el("tr", {}, el("th", { scope: "row" }, r.group), ...COLUMNS.map(([k]) => el("td", {}, fmtInt(r[k])))));
  if (body.length === 0) body.push(el("tr", {}, el("td", { colspan: COLUMNS.length + 1 }, "no requests in this range")));
  node.replaceChildren(el("thead", {}, head), el("tbody", {}, ...body));
}

function chart(node, title, rows, label) {
  const categories = rows.map((r) => ({ label: label(r), values: withUncached(r) }));
  node.replaceChildren(stackedBars(title, categories, SERIES), legend(SERIES));
}

function render(days, models) {
  $("title").textContent = `Usage of tenant ${days.tenant}`;
  const total = days.data.reduce((acc, r) => ({ requests: acc.requests + r.requests, tokens: acc.tokens + r.total_tokens }),
    { requests: 0, tokens: 0 });
  $("summary").textContent = `${fmtInt(total.requests)} requests, ${fmtInt(total.tokens)} tokens since ${
    new Date(days.since * 1000).toISOString().slice(0, 16).replace("T", " ")} UTC`;
  const filled = fillDays(days.data, days.since);
  chart($("day-chart"), "Tokens per day", filled, (r) => r.group.slice(5));
  table($("day-table"), "day", days.data);
  chart($("model-chart"), "Tokens per model", models.data, (r) => r.group);
  table($("model-table"), "model", models.data);
}

async function load() {
  const key = secrets.get(KEY_STORE);
  $("error").hidden = true;
  if (!key) {
    $("summary").textContent = "Paste an API key above to see its tenant's usage.";
    return;
  }
  const since = encodeURIComponent($("since").value);
  try {
    const [days, models] = await Promise.all([getJSON(`/v1/usage?by=day&since=${since}`, key),
      getJSON(`/v1/usage?by=model&since=${since}`, key)]);
    render(days, models);
  } catch (err) {
    $("error").hidden = false;
    $("error").textContent = describe(err);
  }
}

bindSecret({ store: KEY_STORE, input: $("key"), use: $("use-key"), forget: $("forget-key"), state: $("key-state"),
  onChange: load });
$("since").addEventListener("change", load);
$("refresh").addEventListener("click", load);
