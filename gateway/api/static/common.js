// Shared by the three pages: where secrets live (this tab's sessionStorage only: never a URL, a cookie or
// local storage), DOM building that never parses HTML, and error messages people can act on.

export const KEY_STORE = "kvgate.apiKey";
export const ADMIN_STORE = "kvgate.adminToken";

export function $(id) {
  const node = document.getElementById(id);
  if (node === null) throw new Error(`missing #${id}`);
  return node;
}

// Children that are strings become Text nodes: model output and server messages are never parsed as markup.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else node.setAttribute(name, String(value));
  }
  node.append(...children.map((c) => (c instanceof Node ? c : String(c))));
  return node;
}

export const secrets = {
  get: (name) => sessionStorage.getItem(name) || "",
  set: (name, value) => sessionStorage.setItem(name, value),
  forget: (name) => sessionStorage.removeItem(name),
};

// Wires a secret's input and its "use" / "forget" buttons; onChange(value) runs on load and on every change.
export function bindSecret({ store, input, use, forget, state, onChange }) {
  const show = (value) => {
    // An API key's public prefix helps tell keys apart; nothing of an admin token is shown.
    const what = value.startsWith("kvg-") ? `using key ${value.slice(0, 8)}…` : "token set";
    state.textContent = value ? `${what}; kept in this tab only (sessionStorage)` : "nothing stored in this tab";
  };
  const apply = () => {
    const value = input.value.trim();
    if (value) secrets.set(store, value);
    else secrets.forget(store);
    input.value = "";
    show(value);
    onChange(value);
  };
  use.addEventListener("click", apply);
  input.addEventListener("keydown", (e) => { if (e.key === "Enter") apply(); });
  forget.addEventListener("click", () => {
    secrets.forget(store);
    input.value = "";
    show("");
    onChange("");
  });
  const current = secrets.get(store);
  show(current);
  onChange(current);
}

export class ApiError extends Error {
  constructor(status, message, code, retryAfter) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter; // seconds, or null
  }
}

// retry-after-ms is exact where the gateway sends it; retry-after is whole seconds (or an HTTP date).
function retryAfterSeconds(headers) {
  const ms = Number(headers.get("retry-after-ms"));
  if (headers.get("retry-after-ms") !== null && Number.isFinite(ms)) return Math.max(0, ms / 1000);
  const raw = headers.get("retry-after");
  if (raw === null) return null;
  const seconds = Number(raw);
  if (Number.isFinite(seconds)) return Math.max(0, seconds);
  const when = Date.parse(raw);
  return Number.isNaN(when) ? null : Math.max(0, (when - Date.now()) / 1000);
}

// An OpenAI-shaped error body ({"error": {"message", "code"}}) from a failed response, or its status text.
export async function apiError(res) {
  let message = `${res.status} ${res.statusText}`;
  let code = null;
  try {
    const body = await res.json();
    if (body && body.error) {
      message = String(body.error.message ?? message);
      code = body.error.code ?? null;
    }
  } catch {
    // not JSON (a proxy's page): the status line says enough
  }
  return new ApiError(res.status, message, code, retryAfterSeconds(res.headers));
}

export function describe(err) {
  if (!(err instanceof ApiError)) return `Could not reach the gateway: ${err.message}`;
  const tail = `${err.message}${err.code ? ` [${err.code}]` : ""}`;
  switch (err.status) {
    case 401: return err.code === "invalid_admin_token" ? `Invalid admin token (401): ${tail}. Paste the right one above.`
      : `Invalid API key (401): ${tail}. Paste a valid key above.`;
    case 403: return `Not allowed (403): ${tail}`;
    case 429: return err.code === "insufficient_quota" ? `Quota used up (429): ${tail}` : `Rate limited (429): ${tail}`;
    case 503: return `The gateway cannot take this request now (503): ${tail}`;
    default: return `Error ${err.status}: ${tail}`;
  }
}

export async function getJSON(path, token, signal) {
  const res = await fetch(path, { headers: { Authorization: `Bearer ${token}` }, signal });
  if (!res.ok) throw await apiError(res);
  return res.json();
}

// Shows `text` in `node` followed by a live "retry in N s"; calls done() at zero. Returns a cancel function.
export function countdown(node, text, seconds, done) {
  const until = Date.now() + seconds * 1000;
  let timer = null;
  const tick = () => {
    const left = Math.ceil((until - Date.now()) / 1000);
    if (left <= 0) {
      clearInterval(timer);
      node.textContent = `${text} You can retry now.`;
      done();
      return;
    }
    node.textContent = `${text} Retry in ${left} s.`;
  };
  timer = setInterval(tick, 250);
  tick();
  return () => clearInterval(timer);
}

export function fmtInt(n) {
  return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US");
}

export function fmtNum(n, digits = 1) {
  return n === null || n === undefined || !Number.isFinite(n) ? "–" : n.toFixed(digits);
}
