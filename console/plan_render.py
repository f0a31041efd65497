"""``kvgatectl plan``'s output: a Rich table for people, and the comparison with a running gateway (``--url``):
its workers' own KV pool (``Hello`` in ``/admin/workers``) and their measured decode tokens/s (two samples of the
cumulative ``generation_tokens_total`` over an interval, on the workers' clocks)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import httpx
from rich import box
from rich.console import Console
from rich.table import Table

from console.plan import decode_tokens_s
from console.plan_presets import GIB, MIB


def _b(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / MIB:,.3f} MiB"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f} tok/s"


def _pairs(r: Mapping[str, Any]) -> list[tuple[str, str]]:
    m, d = r["model"], r["device"]
    rows = [
        ("model", f"{m['name']}: {m['num_layers']} layers, {m['num_heads']} heads / {m['num_kv_heads']} KV heads, "
                  f"head_dim {m['head_dim']}, {m['params'] / 1e9:,.3f} B params"),
        ("device", f"{d['name']}: {_b(d['memory_bytes'])}, {d['bandwidth_bytes_s'] / 1e9:,.0f} GB/s {d['note']}"),
        ("dtypes", f"weights {r['weight_dtype']}, KV {r['kv_dtype']}; block {r['block_size']} tokens; "
                   f"utilization {r['utilization']}"),
        ("weight bytes", _b(r["weight_bytes"])),
        ("KV bytes / token", f"{r['kv_bytes_per_token']:,} B ({_b(r['kv_bytes_per_token'])}); without GQA "
                             f"{_b(r['kv_bytes_per_token_without_gqa'])}"),
        (f"KV / sequence ({r['max_model_len']:,} tok)", _b(r["kv_bytes_per_sequence"])),
        ("KV pool", f"{_b(r['kv_pool_bytes'])} = {r['num_blocks']:,} blocks = {r['kv_tokens']:,} tokens"),
        ("sequences at max len", f"{r['sequences_at_max_len']:,}" + ("" if r["fits"] else "  (does NOT fit)")),
        ("decode bound, batch 1", _rate(r["decode_tokens_s_batch1"])),
    ]
    w = r.get("workload")
    if w:
        rows += [("workload", f"prompt {w['prompt']['spec']} (mean {w['prompt']['mean']:,.0f}, p99 "
                              f"{w['prompt']['p99']:,.0f}), output {w['output']['spec']} (mean "
                              f"{w['output']['mean']:,.0f}, p99 {w['output']['p99']:,.0f})"),
                 ("sequences that fit", f"{w['sequences_fit_mean']:,} at mean length, {w['sequences_fit_p99']:,} "
                                        "at p99 length")]
        if "concurrency" in w:
            kv = "  (KV-limited)" if w["kv_limited"] else ""
            rows.append((f"decode bound at concurrency {w['concurrency']}",
                         f"{_rate(w['decode_tokens_s'])} total, {_rate(w['per_sequence_tokens_s'])} per sequence "
                         f"(batch {w['batch']}){kv}"))
        if "request_rate" in w:
            need = w["concurrency_needed"]
            verdict = "sustainable" if w["sustainable"] else "NOT sustainable"
            rows.append((f"{w['request_rate']:g} req/s", f"needs {_rate(w['tokens_s_needed'])}: concurrency "
                         f"{'-' if need is None else f'{need:,.1f}'}, {verdict}"))
    return rows


def render_plan(console: Console, result: Mapping[str, Any]) -> None:
    table = Table(title="kvgatectl plan", box=box.SIMPLE_HEAD, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in _pairs(result):
        table.add_row(name, value)
    console.print(table)
    remote = result.get("gateway")
    if remote:
        render_remote(console, remote)


def render_remote(console: Console, remote: Mapping[str, Any]) -> None:
    table = Table(title=f"against {remote['url']} ({remote['model']})", box=box.SIMPLE_HEAD)
    for col in ("worker", "max len", "KV blocks", "KV tokens", "seqs at max len", "planned blocks",
                "running", "bound at that batch", "measured"):
        table.add_column(col, justify="right")
    for w in remote["workers"]:
        table.add_row(w["worker"], f"{w['max_model_len']:,}", f"{w['num_kv_blocks']:,}", f"{w['kv_tokens']:,}",
                      f"{w['sequences_at_max_len']:,}", f"{w['planned_blocks']:,}", f"{w['running']}",
                      _rate(w["bound_tokens_s"]), _rate(w["measured_tokens_s"]))
    console.print(table)


def _get_workers(client: httpx.Client) -> dict[str, Any]:
    resp = client.get("/admin/workers")
    if resp.status_code != 200:
        raise RuntimeError(f"/admin/workers answered HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json()
    if not isinstance(data, dict):
        raise RuntimeError("/admin/workers did not answer a JSON object")
    return data


def compare_gateway(url: str, token: str | None, result: Mapping[str, Any], interval: float,
                    transport: httpx.BaseTransport | None = None) -> dict[str, Any]:
    """The workers' reported KV pool against the plan's, and their measured decode rate against the bound."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=10.0, transport=transport) as client:
            first = _get_workers(client)
            time.sleep(interval)
            second = _get_workers(client)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach the gateway at {url}: {e}") from None
    before = {w["worker"]: w.get("stats") or {} for w in first.get("data", [])}
    rows = [_remote_row(w, before.get(w["worker"], {}), result) for w in second.get("data", [])]
    return {"url": url, "model": second.get("model"), "interval_s": interval, "workers": rows}


def _remote_row(w: Mapping[str, Any], prev: Mapping[str, Any], r: Mapping[str, Any]) -> dict[str, Any]:
    hello, stats = w.get("hello") or {}, w.get("stats") or {}
    block, blocks, max_len = int(hello["block_size"]), int(hello["num_kv_blocks"]), int(hello["max_model_len"])
    measured = None
    dt = float(stats.get("timestamp", 0)) - float(prev.get("timestamp", 0))
    if prev and dt > 0:
        measured = (stats["generation_tokens_total"] - prev["generation_tokens_total"]) / dt
    running = int(stats.get("running", 0))
    per_block = r["kv_bytes_per_token"] * block
    kv_used = float(stats.get("kv_usage", 0.0)) * blocks * block
    ctx = kv_used / running if running else 0.0
    bound = (decode_tokens_s(r["device"]["bandwidth_bytes_s"], r["weight_bytes"], running, ctx,
                             r["kv_bytes_per_token"]) if running else None)
    return {"worker": w["worker"], "max_model_len": max_len, "block_size": block, "num_kv_blocks": blocks,
            "kv_tokens": blocks * block, "sequences_at_max_len": blocks // -(-max_len // block),
            "planned_blocks": r["kv_pool_bytes"] // per_block, "running": running,
            "mean_context": ctx, "bound_tokens_s": bound, "measured_tokens_s": measured}
