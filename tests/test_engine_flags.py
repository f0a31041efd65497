"""Engine flags are defined once (``common.engine_flags``) and reach every entry point: ``kvgate worker`` parses
each into the engine config, ``kvgate serve`` takes each and forwards it to its workers' command line (parsed back
by the worker to the same value), and the offline ``LLM`` has a keyword for each (or the table says why not)."""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any

import pytest

from common.engine_flags import ENGINE_FLAGS, OFFLINE, PROCESS_ONLY
from gateway.cli import add_serve_parser, config_from_args
from workers.llm import LLM
from workers.process.worker_args import add_engine_args, engine_config

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
# A value other than the default for every flag (a flag added to the table without one fails here first).
SAMPLES: dict[str, list[str]] = {
    "device": ["--device", "cuda"], "dtype": ["--dtype", "bfloat16"], "kv_cache_dtype": ["--kv-cache-dtype", "int8"],
    "quantization": ["--quantization", "int4"], "max_model_len": ["--max-model-len", "1024"],
    "kv_cache_tokens": ["--kv-cache-tokens", "4096"], "kv_cache_memory_gib": ["--kv-cache-memory-gib", "0.5"],
    "block_size": ["--block-size", "32"], "max_num_seqs": ["--max-num-seqs", "8"],
    "max_num_batched_tokens": ["--max-num-batched-tokens", "256"], "target_step_ms": ["--target-step-ms", "250"],
    "no_prefix_caching": ["--no-prefix-caching"], "num_threads": ["--num-threads", "2"], "seed": ["--seed", "7"],
    "speculative_config": ["--speculative-config", SPEC], "scheduling_policy": ["--scheduling-policy", "fcfs"],
    "enforce_eager": ["--enforce-eager"], "background_prefill_tokens": ["--background-prefill-tokens", "64"],
    "lora_dir": ["--lora-dir", "/srv/adapters"], "max_loras": ["--max-loras", "2"],
    "max_cpu_loras": ["--max-cpu-loras", "16"],
}


def _worker(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


def _serve(argv: list[str]) -> Any:
    root = argparse.ArgumentParser()
    add_serve_parser(root.add_subparsers())
    return config_from_args(root.parse_args(["serve", *argv]))


def test_every_flag_has_a_sample() -> None:
    assert set(SAMPLES) == {f.dest for f in ENGINE_FLAGS}


@pytest.mark.parametrize("flag", ENGINE_FLAGS, ids=lambda f: f.dest)
def test_the_worker_takes_every_flag(flag: Any) -> None:
    default, given = _worker([]), _worker(SAMPLES[flag.dest])
    assert getattr(given, flag.dest) != getattr(default, flag.dest)
    if flag.dest in PROCESS_ONLY:  # read by the worker process itself (its step sizing), not the engine
        from workers.process import worker

        assert f"a.{flag.dest}" in inspect.getsource(worker._size_steps)
    else:
        assert engine_config(given) != engine_config(default)  # the value reached the engine's config


@pytest.mark.parametrize("flag", ENGINE_FLAGS, ids=lambda f: f.dest)
def test_serve_forwards_every_flag_to_its_workers(flag: Any) -> None:
    assert _serve([]).engine.argv() == []  # nothing given: the workers' own defaults
    forwarded = _serve(SAMPLES[flag.dest]).engine.argv()
    assert forwarded[0] == flag.option and len(forwarded) == len(SAMPLES[flag.dest])
    assert getattr(_worker(forwarded), flag.dest) == getattr(_worker(SAMPLES[flag.dest]), flag.dest)


def test_serve_refuses_out_of_range_values_before_starting_workers() -> None:
    for argv in (["--num-threads", "0"], ["--kv-cache-memory-gib", "0"], ["--max-model-len", "-3"]):
        with pytest.raises(ValueError, match=argv[0]):
            _serve(argv)
    with pytest.raises(SystemExit):  # argparse: a usage error
        _serve(["--speculative-config", '{"method": "eagle"}'])


def test_the_offline_llm_has_a_keyword_for_every_flag() -> None:
    params = set(inspect.signature(LLM.__init__).parameters)
    for flag in ENGINE_FLAGS:
        assert (flag.dest in OFFLINE) != (flag.dest in PROCESS_ONLY), flag.dest
        if flag.dest in OFFLINE:
            assert OFFLINE[flag.dest] in params, flag.dest
