"""``kvgatectl plan``: the seeds' KV-cache worksheet as arithmetic.

Decode is bound by memory bandwidth: each step reads every weight once plus the KV cache of every sequence in
the batch, and yields one token per sequence. So with weights W bytes, B sequences of average context c tokens
and k KV bytes per token, a step moves W + B*c*k bytes and

    tokens/s <= B * bandwidth / (W + B*c*k)

an upper bound (peak bandwidth, no compute, no prefill, no scheduling gaps). Memory bounds the batch: the KV
pool is what is left of ``memory * utilization`` after the weights, cut into blocks of ``block_size`` tokens;
a sequence needs ceil(len / block_size) blocks. A request rate r with mean output length o needs r*o tokens/s;
by Little's law the concurrency that serves it solves B = r*o*(W + B*c*k)/bandwidth.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from console.plan_model import PlanInputError
from console.plan_presets import (DEVICE_ALIASES, DEVICES, GIB, KV_DTYPE_BYTES, KV_ROW_SCALE_BYTES, WEIGHT_DTYPE_BYTES,
                                  DeviceSpec, ModelShape, device_names)

_SAMPLES = 20000
_MIN_COPIES = 3  # a busy host's one slow copy is not its bandwidth


@dataclass(frozen=True)
class LengthStats:
    spec: str
    mean: float
    p50: float
    p99: float


def length_stats(spec: str, seed: int = 0) -> LengthStats:
    """``N`` (fixed), ``uniform:LO:HI``, ``normal:MEAN:STD`` or ``exp:MEAN`` (token counts, clipped to >= 1)."""
    kind, _, rest = spec.partition(":")
    rng = random.Random(seed)
    try:
        args = [float(x) for x in rest.split(":")] if rest else []
        if not rest:
            draw = [float(int(kind))] * 2
        elif kind == "uniform" and len(args) == 2 and 0 < args[0] <= args[1]:
            draw = [rng.uniform(args[0], args[1]) for _ in range(_SAMPLES)]
        elif kind == "normal" and len(args) == 2 and args[0] > 0 and args[1] >= 0:
            draw = [rng.gauss(args[0], args[1]) for _ in range(_SAMPLES)]
        elif kind == "exp" and len(args) == 1 and args[0] > 0:
            draw = [rng.expovariate(1 / args[0]) for _ in range(_SAMPLES)]
        else:
            raise ValueError(spec)
    except ValueError:
        raise PlanInputError(f"bad length distribution {spec!r}: N, uniform:LO:HI, normal:MEAN:STD or exp:MEAN") \
            from None
    values = sorted(max(1.0, round(x)) for x in draw)
    if values[0] < 1 or not all(math.isfinite(v) for v in values):
        raise PlanInputError(f"bad length distribution {spec!r}")
    return LengthStats(spec, statistics.fmean(values), values[len(values) // 2],
                       values[min(len(values) - 1, int(len(values) * 0.99))])


def measure_bandwidth(seconds: float = 0.5, size_bytes: int = 256 << 20) -> float:
    """Bytes/s of a large numpy copy (read + write), the best of a few: what one process sees on this host."""
    import numpy as np

    src = np.ones(size_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # untimed: the first copy also faults dst's pages in (10x slower than a copy)
    best = 0.0
    end = time.perf_counter() + seconds
    for copies in itertools.count(1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t0))
        if copies >= _MIN_COPIES and time.perf_counter() > end:
            break
    return best


def this_machine(bandwidth_gbs: float | None, measure: bool) -> DeviceSpec:
    meminfo: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            meminfo[name] = int(value.split()[0]) * 1024
    if bandwidth_gbs is None and not measure:
        raise PlanInputError("device this-machine needs --bandwidth-gbs N or --measure-bandwidth")
    bandwidth = bandwidth_gbs * 1e9 if bandwidth_gbs is not None else measure_bandwidth()
    how = "stated" if bandwidth_gbs is not None else "measured (numpy copy, one process)"
    return DeviceSpec(f"this machine ({os.cpu_count()} CPUs, MemAvailable)", meminfo.get("MemAvailable", 0),
                      bandwidth, f"bandwidth {how}")


def device_spec(name: str, bandwidth_gbs: float | None = None, measure: bool = False) -> DeviceSpec:
    key = DEVICE_ALIASES.get(name.lower(), name.lower())
    if key in ("this-machine", "this", "cpu", "local"):
        return this_machine(bandwidth_gbs, measure)
    if key not in DEVICES:
        raise PlanInputError(f"unknown device {name!r}: one of {', '.join(device_names())}")
    spec = DEVICES[key]
    if bandwidth_gbs is not None:
        return DeviceSpec(spec.name, spec.memory_bytes, bandwidth_gbs * 1e9, "bandwidth stated")
    return spec


@dataclass(frozen=True)
class PlanInput:
    shape: ModelShape
    device: DeviceSpec
    weight_dtype: str = "fp16"
    kv_dtype: str = "fp16"
    max_model_len: int | None = None
    block_size: int = 16
    utilization: float = 0.9
    reserve_bytes: int = 0  # activations, CUDA context, runtime: not KV, not weights
    prompt: LengthStats | None = None
    output: LengthStats | None = None
    concurrency: int | None = None
    request_rate: float | None = None


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """K and V, every layer, every KV head: 2 * layers * kv_heads * (head_dim * bytes + the row's scale)."""
    row = shape.head_dim * KV_DTYPE_BYTES[kv_dtype] + KV_ROW_SCALE_BYTES.get(kv_dtype, 0)
    return 2 * shape.num_layers * shape.num_kv_heads * row


def decode_tokens_s(bandwidth: float, weight_bytes: float, batch: float, ctx: float, kv_token: int) -> float:
    return batch * bandwidth / (weight_bytes + batch * ctx * kv_token)


def plan(p: PlanInput) -> dict[str, Any]:
    shape = p.shape
    max_len = p.max_model_len or shape.max_position_embeddings
    if max_len < 1:
        raise PlanInputError("give --max-model-len (the model states no context length)")
    params = shape.param_count()
    weight_bytes = int(params * WEIGHT_DTYPE_BYTES[p.weight_dtype])
    kv_token = kv_bytes_per_token(shape, p.kv_dtype)
    kv_pool = int(p.device.memory_bytes * p.utilization) - weight_bytes - p.reserve_bytes
    block_bytes = kv_token * p.block_size
    blocks = max(0, kv_pool // block_bytes)
    blocks_per_seq = math.ceil(max_len / p.block_size)
    out: dict[str, Any] = {
        "model": asdict(shape) | {"params": params}, "device": asdict(p.device),
        "weight_dtype": p.weight_dtype, "kv_dtype": p.kv_dtype, "max_model_len": max_len,
        "block_size": p.block_size, "utilization": p.utilization, "reserve_bytes": p.reserve_bytes,
        "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token,
        "kv_bytes_per_token_without_gqa": kv_token * shape.num_heads // shape.num_kv_heads,
        "kv_bytes_per_sequence": kv_token * max_len, "kv_pool_bytes": max(0, kv_pool), "num_blocks": blocks,
        "kv_tokens": blocks * p.block_size, "sequences_at_max_len": blocks // blocks_per_seq,
        "decode_tokens_s_batch1": decode_tokens_s(p.device.bandwidth_bytes_s, weight_bytes, 1, max_len, kv_token),
        "fits": kv_pool >= block_bytes * blocks_per_seq,
    }
    if p.prompt and p.output:
        out["workload"] = _workload(p, p.prompt, p.output, (weight_bytes, kv_token, blocks))
    return out


def _workload(p: PlanInput, prompt: LengthStats, output: LengthStats, sizes: tuple[int, int, int]
              ) -> dict[str, Any]:
    weight_bytes, kv_token, blocks = sizes
    bw = p.device.bandwidth_bytes_s
    # A sequence holds prompt + all of its output at its end; on average over its decode, prompt + output/2.
    peak_len = prompt.p99 + output.p99
    mean_ctx = prompt.mean + output.mean / 2
    fit_p99 = blocks // math.ceil(peak_len / p.block_size)
    fit_mean = blocks // math.ceil((prompt.mean + output.mean) / p.block_size)
    w: dict[str, Any] = {"prompt": asdict(prompt), "output": asdict(output), "mean_context": mean_ctx,
                         "sequences_fit_p99": fit_p99, "sequences_fit_mean": fit_mean}
    if p.concurrency is not None:
        batch = min(p.concurrency, fit_mean)
        tps = decode_tokens_s(bw, weight_bytes, batch, mean_ctx, kv_token) if batch else 0.0
        w |= {"concurrency": p.concurrency, "batch": batch, "decode_tokens_s": tps,
              "per_sequence_tokens_s": tps / batch if batch else 0.0, "kv_limited": batch < p.concurrency}
    if p.request_rate is not None:
        need = p.request_rate * output.mean
        ceiling = bw / (mean_ctx * kv_token)  # tokens/s as B grows without bound: the KV reads alone
        batch_needed = need * weight_bytes / (bw - need * mean_ctx * kv_token) if need < ceiling else math.inf
        w |= {"request_rate": p.request_rate, "tokens_s_needed": need,
              "concurrency_needed": batch_needed if math.isfinite(batch_needed) else None,
              "sustainable": math.isfinite(batch_needed) and batch_needed <= fit_mean,
              "request_latency_s": (batch_needed / p.request_rate) if math.isfinite(batch_needed) else None}
    return w


def gib(n: float) -> float:
    return n / GIB
