// Live worker table for operators, from GET /admin/workers (the pool's worker table as JSON, admin token),
// sampled every second. Rates are computed exactly as `kvgatectl top` does from /metrics: a counter's increase
// between two samples (a drop, i.e. a restarted worker, counts as 0) over the time between them.
import { $, ADMIN_STORE, bindSecret, describe, el, fmtInt, fmtNum, getJSON, secrets } from "/assets/common.js";

const REFRESH_MS = 1000;
const FETCH_TIMEOUT_MS = 3000;
// Stats fields with a column of their own; any other field a worker reports is listed under "more".
const SHOWN = new Set(["worker_id", "running", "waiting", "kv_usage", "num_free_blocks", "num_total_blocks",
  "num_preemptions", "prefix_queries", "prefix_hits", "prompt_tokens_total", "generation_tokens_total", "timestamp"]);
const HEADINGS = ["worker", "pid", "running", "waiting", "KV usage", "prompt tok/s", "gen tok/s", "preemptions",
  "prefix hit rate", "in flight", "heartbeat", "more"];

let previous = null; // the last sample, for rates
let timer = null;
let generation = 0; // bumped when the token changes, so a reply to the old token is dropped

function increase(cur, prev, field) {
  return Math.max(0, cur.stats[field] - prev.stats[field]);
}

function rates(w, prev, dt) {
  if (!prev || !prev.stats || !w.stats || !(dt > 0)) return { prompt: null, gen: null, hit: null };
  const queries = increase(w, prev, "prefix_queries");
  return {
    prompt: increase(w, prev, "prompt_tokens_total") / dt,
    gen: increase(w, prev, "generation_tokens_total") / dt,
    hit: queries > 0 ? Math.min(1, increase(w, prev, "prefix_hits") / queries) : null,
  };
}

function more(w) {
  const parts = Object.entries(w.stats || {}).filter(([k]) => !SHOWN.has(k))
    .map(([k, v]) => `${k}: ${typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : v}`);
  for (const [k, n] of Object.entries(w.stats_counts || {})) parts.push(`${k}: ${n}`);
  return parts.join(" · ");
}

function row(w, prev, dt) {
  const s = w.stats || {};
  const r = rates(w, prev, dt);
  const kv = s.kv_usage === undefined ? "–" : `${fmtNum(100 * s.kv_usage)} %`;
  const silent = w.seconds_since_heartbeat > 2 * REFRESH_MS / 1000;
  const cells = [w.worker, w.hello.pid, fmtInt(s.running), fmtInt(s.waiting), kv, fmtNum(r.prompt), fmtNum(r.gen),
    fmtInt(s.num_preemptions), r.hit === null ? "–" : `${fmtNum(100 * r.hit)} %`, fmtInt(w.in_flight),
    `${fmtNum(w.seconds_since_heartbeat)} s ago`, more(w)];
  return el("tr", { "data-worker": w.worker, class: silent ? "silent" : "" }, ...cells.map((c) => el("td", {}, c)));
}

function render(sample) {
  const before = previous && new Map(previous.data.map((w) => [w.worker, w]));
  const dt = previous ? sample.sampled_at - previous.sampled_at : null;
  const rows = sample.data.map((w) => row(w, before && before.get(w.worker), dt));
  if (rows.length === 0) rows.push(el("tr", {}, el("td", { colspan: HEADINGS.length }, "no live worker")));
  $("workers").replaceChildren(el("thead", {}, el("tr", {}, ...HEADINGS.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, ...rows));
  const gen = sample.data.map((w) => rates(w, before && before.get(w.worker), dt).gen).filter((v) => v !== null);
  $("summary").textContent = `model ${sample.model} · ${sample.workers_ready} worker${sample.workers_ready === 1 ? "" : "s"} ready · ${
    sample.requests_in_flight} request${sample.requests_in_flight === 1 ? "" : "s"} in flight · ${gen.length ? fmtNum(gen.reduce((a, b) => a + b, 0)) : "–"} output tok/s`;
  $("status").textContent = `updated ${new Date(sample.time * 1000).toLocaleTimeString("en-GB")}`;
  previous = sample;
}

async function poll(mine) {
  const token = secrets.get(ADMIN_STORE);
  if (!token || mine !== generation) return;
  try {
    const sample = await getJSON("/admin/workers", token, AbortSignal.timeout(FETCH_TIMEOUT_MS));
    if (mine !== generation) return;
    $("error").hidden = true;
    render(sample);
  } catch (err) {
    if (mine !== generation) return;
    $("error").hidden = false;
    $("error").textContent = err.name === "TimeoutError" ? "The gateway did not answer within 3 s." : describe(err);
    if (err.status === 401 || err.status === 403) return; // a wrong token stays wrong: stop asking
  }
  // The next sample is asked for only once this one is in, so a slow gateway never piles up requests.
  timer = setTimeout(() => poll(mine), REFRESH_MS);
}

function restart(token) {
  generation += 1;
  clearTimeout(timer);
  previous = null;
  $("workers").replaceChildren();
  $("summary").textContent = token ? "" : "Paste the gateway's admin token (--admin-token) above.";
  $("error").hidden = true;
  if (token) poll(generation);
}

bindSecret({ store: ADMIN_STORE, input: $("key"), use: $("use-key"), forget: $("forget-key"), state: $("key-state"),
  onChange: restart });
