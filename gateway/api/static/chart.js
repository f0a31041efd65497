// A stacked bar chart in plain SVG, built with DOM calls (no markup strings, no inline styles: colours come
// from the stylesheet through the series' class names, which the Content-Security-Policy allows).
const SVG = "http://www.w3.org/2000/svg";
const W = 640;
const H = 240;
const PAD = { left: 64, right: 12, top: 12, bottom: 40 };

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== null) node.textContent = text;
  return node;
}

// 1, 2 or 5 times a power of ten: axis steps people read at a glance.
function niceStep(max, ticks) {
  const raw = max / ticks;
  const power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
}

function compact(n) {
  return n >= 1e6 ? `${+(n / 1e6).toFixed(1)}M` : n >= 1e3 ? `${+(n / 1e3).toFixed(1)}k` : String(n);
}

function axis(root, top, step) {
  const y = (v) => PAD.top + (H - PAD.top - PAD.bottom) * (1 - v / top);
  for (let v = 0; v <= top; v += step) {
    root.append(svg("line", { class: "grid", x1: PAD.left, x2: W - PAD.right, y1: y(v), y2: y(v) }));
    root.append(svg("text", { class: "tick", x: PAD.left - 6, y: y(v) + 4, "text-anchor": "end" }, compact(v)));
  }
  return y;
}

// categories: [{label, values: {seriesKey: number}}]; series: [{key, label}] drawn bottom-up.
export function stackedBars(title, categories, series) {
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "chart" });
  root.append(svg("title", {}, title));
  const totals = categories.map((c) => series.reduce((sum, s) => sum + (c.values[s.key] || 0), 0));
  const max = Math.max(1, ...totals);
  const step = niceStep(max, 4);
  const y = axis(root, Math.ceil(max / step) * step, step);
  const slot = (W - PAD.left - PAD.right) / Math.max(1, categories.length);
  const labelEvery = Math.ceil(categories.length / 12); // at most a dozen labels, whatever the range
  categories.forEach((c, i) => {
    const x = PAD.left + i * slot + slot * 0.15;
    let base = 0;
    series.forEach((s, k) => {
      const v = c.values[s.key] || 0;
      if (v > 0) {
        const bar = svg("rect", { class: `bar s${k}`, x, width: slot * 0.7, y: y(base + v), height: y(base) - y(base + v) });
        bar.append(svg("title", {}, `${c.label}: ${s.label} ${v.toLocaleString("en-US")}`));
        root.append(bar);
      }
      base += v;
    });
    if (i % labelEvery === 0) {
      root.append(svg("text", { class: "tick", x: x + slot * 0.35, y: H - PAD.bottom + 16, "text-anchor": "middle" }, c.label));
    }
  });
  return root;
}

export function legend(series) {
  const box = document.createElement("div");
  box.className = "legend";
  series.forEach((s, k) => {
    const swatch = svg("svg", { width: 12, height: 12, viewBox: "0 0 12 12" });
    swatch.append(svg("rect", { class: `bar s${k}`, width: 12, height: 12 }));
    const item = document.createElement("span");
    item.append(swatch, ` ${s.label}`);
    box.append(item);
  });
  return box;
}
