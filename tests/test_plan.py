"""kvgatectl plan: the arithmetic against the seeds' worked examples, smollm2 read from its real GGUF, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from console.kvgatectl import app
from console.plan import PlanInput, decode_tokens_s, device_spec, kv_bytes_per_token, length_stats, plan
from console.plan_model import PlanInputError, load_shape
from console.plan_presets import DEVICES, GIB, MIB, MODELS, ModelShape

MHA_7B = ModelShape("mha", 32, 32, 32, 128, 4096, 11008, 32000, False, 4096)


def test_one_8k_sequence_of_a_32_layer_mha_model_is_4_gib() -> None:
    assert kv_bytes_per_token(MHA_7B, "fp16") == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    r = plan(PlanInput(MHA_7B, DEVICES["h100-sxm"], max_model_len=8192))
    assert r["kv_bytes_per_sequence"] == 4 * GIB


def test_llama3_70b_gqa_is_0_31_mib_per_token_and_2_5_without() -> None:
    shape = MODELS["llama-3-70b"]
    r = plan(PlanInput(shape, DEVICES["h200"], weight_dtype="int4", max_model_len=8192))
    assert r["kv_bytes_per_token"] == 327_680  # 2 * 80 * 8 * 128 * 2
    assert r["kv_bytes_per_token"] / MIB == pytest.approx(0.3125)
    assert r["kv_bytes_per_token_without_gqa"] == 2.5 * MIB  # 64 KV heads: 2.62 MB, the seeds' "~2.5 MB"
    assert shape.param_count() == pytest.approx(70.55e9, rel=1e-3)


def test_blocks_fit_and_bandwidth_bound_follow_from_the_pool() -> None:
    r = plan(PlanInput(MODELS["llama-3-8b"], DEVICES["a100-80gb"], max_model_len=8192, reserve_bytes=2 * GIB))
    pool = int(81920 * MIB * 0.9) - r["weight_bytes"] - 2 * GIB
    assert r["weight_bytes"] == MODELS["llama-3-8b"].param_count() * 2
    assert r["num_blocks"] == pool // (r["kv_bytes_per_token"] * 16)
    assert r["sequences_at_max_len"] == r["num_blocks"] // 512
    assert r["decode_tokens_s_batch1"] == pytest.approx(2.039e12 / (r["weight_bytes"] + 8192 * 131072))


def test_int8_kv_halves_fp16_plus_row_scales_and_weights_count_block_scales() -> None:
    fp16 = plan(PlanInput(MODELS["mistral-7b"], DEVICES["l4"], weight_dtype="int8", kv_dtype="fp16"))
    int8 = plan(PlanInput(MODELS["mistral-7b"], DEVICES["l4"], weight_dtype="int8", kv_dtype="int8"))
    # 128 int8 codes + one fp32 scale per token, layer and KV head (kvgate's int8 cache) against 128 fp16
    assert int8["kv_bytes_per_token"] == 2 * 32 * 8 * (128 + 4) and fp16["kv_bytes_per_token"] == 2 * 32 * 8 * 256
    assert fp16["weight_bytes"] == int(MODELS["mistral-7b"].param_count() * 34 / 32)


def test_a_model_that_does_not_fit_says_so() -> None:
    r = plan(PlanInput(MODELS["llama-3-70b"], DEVICES["rtx-4090"], max_model_len=8192))
    assert r["num_blocks"] == 0 and r["sequences_at_max_len"] == 0 and not r["fits"]


def test_request_rate_concurrency_solves_littles_law() -> None:
    inp = PlanInput(MODELS["llama-3-8b"], DEVICES["h100-sxm"], prompt=length_stats("1000"),
                    output=length_stats("200"), request_rate=5.0, concurrency=32)
    w = plan(inp)["workload"]
    b, ctx, k = w["concurrency_needed"], w["mean_context"], plan(inp)["kv_bytes_per_token"]
    assert ctx == 1100
    # B sequences decoding at the bound produce exactly the tokens the rate needs
    assert decode_tokens_s(3.35e12, plan(inp)["weight_bytes"], b, ctx, k) == pytest.approx(1000.0)
    assert w["sustainable"] and w["batch"] == 32


def test_length_distributions() -> None:
    assert length_stats("300").mean == 300
    u = length_stats("uniform:100:300")
    assert 195 < u.mean < 205 and 290 < u.p99 <= 300
    assert 430 < length_stats("exp:100").p99 < 490  # ln(100) * 100 = 460
    for bad in ("uniform:5", "normal:-1:2", "x", "exp:0"):
        with pytest.raises(PlanInputError):
            length_stats(bad)


def test_smollm2_from_its_gguf() -> None:
    shape = load_shape("smollm2")
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert shape.vocab_size == 49152 and shape.tied_embeddings
    assert shape.param_count() == 134_515_008  # every tensor in the file, counted
    r = plan(PlanInput(shape, device_spec("this-machine", bandwidth_gbs=20.0), weight_dtype="fp32",
                       kv_dtype="fp32", max_model_len=8192))
    assert r["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4 == 46_080


def test_config_json(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_shape(str(tmp_path)).param_count() == MODELS["llama-3-8b"].param_count()
    with pytest.raises(PlanInputError):
        load_shape(str(tmp_path / "nope.gguf"))


def test_cli_json_and_table() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--model", "llama-3-70b", "--device", "h200", "--dtype", "int4",
                              "--max-model-len", "8192", "--concurrency", "16", "--output-len", "256", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["kv_bytes_per_token"] == 327_680 and data["workload"]["batch"] == 16
    res = runner.invoke(app, ["plan", "--model", "llama-2-7b", "--device", "a10g", "--max-model-len", "8192"])
    assert res.exit_code == 0 and "4.00 GiB" in res.output
    res = runner.invoke(app, ["plan", "--device", "tpu", "--model", "llama-2-7b"])
    assert res.exit_code == 2 and "unknown device" in res.output


def test_table_prints_length_specs_as_written() -> None:
    """Rich reads ':100:' as an emoji code; the table must show the spec the user gave."""
    res = CliRunner().invoke(app, ["plan", "--model", "llama-2-7b", "--prompt-len", "uniform:100:400",
                                   "--output-len", "normal:200:50"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "prompt uniform:100:400 (" in res.output and "output normal:200:50 (" in res.output


def test_against_a_gateway_reads_workers_pool_and_measures_rate() -> None:
    import httpx

    from console.plan_render import compare_gateway

    samples = iter([(100, 10.0), (400, 12.0)])

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer t"
        generated, ts = next(samples)
        hello = {"block_size": 16, "num_kv_blocks": 2048, "max_model_len": 8192}
        stats = {"running": 4, "kv_usage": 0.5, "generation_tokens_total": generated, "timestamp": ts}
        return httpx.Response(200, json={"model": "smollm2", "data": [{"worker": "w0", "hello": hello,
                                                                        "stats": stats}]})

    r = plan(PlanInput(load_shape("llama-2-7b"), DEVICES["l4"], max_model_len=8192))
    got = compare_gateway("http://gw", "t", r, 0.0, transport=httpx.MockTransport(handler))
    row = got["workers"][0]
    assert row["measured_tokens_s"] == 150.0  # 300 tokens over 2 s of worker clock
    assert row["kv_tokens"] == 32768 and row["sequences_at_max_len"] == 4 and row["mean_context"] == 4096
    assert row["bound_tokens_s"] == pytest.approx(decode_tokens_s(300e9, r["weight_bytes"], 4, 4096, 524288))
