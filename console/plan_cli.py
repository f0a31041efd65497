"""The ``kvgatectl plan`` command (registered in ``console.kvgatectl``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from console.render import make_console
from console.plan import PlanInput, device_spec, length_stats, plan
from console.plan_model import PlanInputError, load_shape
from console.plan_presets import GIB, KV_DTYPE_BYTES, WEIGHT_DTYPE_BYTES, canonical_dtype, device_names

_Opt = typer.Option


def plan_command(
    ctx: typer.Context,
    model: Annotated[str, _Opt(help="Preset (llama-3-70b, ...), smollm2, a .gguf, or a config.json / its dir.")
                     ] = "smollm2",
    device: Annotated[str, _Opt(help=f"One of {', '.join(device_names())}.")] = "h100-sxm",
    dtype: Annotated[str, _Opt(help="Weights: fp32, bf16, fp16, int8, int4.")] = "fp16",
    kv_dtype: Annotated[str, _Opt(help="KV cache: fp32, fp16, bf16, fp8, int8.")] = "fp16",
    max_model_len: Annotated[int | None, _Opt(min=1, help="Default: the model's context length.")] = None,
    block_size: Annotated[int, _Opt(min=1, max=256)] = 16,
    utilization: Annotated[float, _Opt(min=0.01, max=1.0, help="Share of device memory for weights + KV.")
                           ] = 0.9,
    reserve_gib: Annotated[float, _Opt(min=0.0, help="Memory kept for activations/runtime (GiB).")] = 0.0,
    prompt_len: Annotated[str | None, _Opt(help="N, uniform:LO:HI, normal:MEAN:STD or exp:MEAN.")] = None,
    output_len: Annotated[str | None, _Opt(help="As --prompt-len.")] = None,
    concurrency: Annotated[int | None, _Opt(min=1, help="Target concurrent sequences.")] = None,
    request_rate: Annotated[float | None, _Opt(min=0.0, help="Target requests/s.")] = None,
    bandwidth_gbs: Annotated[float | None, _Opt(min=0.001, help="Override/state memory bandwidth (GB/s).")
                             ] = None,
    measure_bandwidth: Annotated[bool, _Opt("--measure-bandwidth", help="Measure this machine's.")] = False,
    url: Annotated[str | None, _Opt(help="Compare with a running gateway (default: global --url).")] = None,
    interval: Annotated[float, _Opt(min=0.1, help="Seconds between the two samples of --url.")] = 2.0,
    json_out: Annotated[bool, _Opt("--json", help="Print JSON.")] = False,
) -> None:
    """KV-cache worksheet: weight and KV bytes, blocks, sequences that fit, a decode-bandwidth bound on tok/s."""
    settings = ctx.obj
    try:
        has_workload = prompt_len is not None or output_len is not None
        inp = PlanInput(
            shape=load_shape(model), device=device_spec(device, bandwidth_gbs, measure_bandwidth),
            weight_dtype=canonical_dtype(dtype, WEIGHT_DTYPE_BYTES, "weight"),
            kv_dtype=canonical_dtype(kv_dtype, KV_DTYPE_BYTES, "KV"), max_model_len=max_model_len,
            block_size=block_size, utilization=utilization, reserve_bytes=int(reserve_gib * GIB),
            prompt=length_stats(prompt_len or "512") if has_workload else None,
            output=length_stats(output_len or "256") if has_workload else None,
            concurrency=concurrency, request_rate=request_rate)
        result = plan(inp)
    except PlanInputError as e:
        raise typer.BadParameter(str(e)) from None
    target = url or getattr(settings, "url", None)
    if target:
        from console.plan_render import compare_gateway

        try:
            result["gateway"] = compare_gateway(target, getattr(settings, "admin_token", None), result, interval)
        except (RuntimeError, KeyError, TypeError, ValueError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
    if json_out or getattr(settings, "json", False):
        typer.echo(json.dumps(result, indent=2))
        return
    from console.plan_render import render_plan

    render_plan(make_console(), result)
