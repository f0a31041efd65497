"""Adapters that must be refused, each with a ValueError saying what is wrong, and nothing loaded: wrong shapes,
a bad rank, a truncated or corrupt file, unknown targets, unsupported PEFT features, stray tensors."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.lora_support import ATTN, lora_engine, make_adapter
from tests.tiny import hf_model
from workers.core.sampling_params import SamplingParams
from workers.lora import LoraRegistry, load_adapter
from workers.models.llama import LlamaConfig

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
Q0_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model(seed=0)


@pytest.fixture(scope="module")
def good(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(hf, tmp_path_factory.mktemp("good") / "a", ATTN, r=8, seed=1)


def _edit_config(**changes: Any) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        cfg = json.loads((d / CONFIG).read_text())
        cfg.update(changes)
        (d / CONFIG).write_text(json.dumps(cfg))
    return edit


def _edit_weights(fn: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        sd = load_file(str(d / WEIGHTS))
        fn(sd)
        save_file(sd, str(d / WEIGHTS))
    return edit


def _truncate(d: Path) -> None:
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[: len(data) // 2])


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "wrong shape": (_edit_weights(lambda sd: sd.__setitem__(Q0_A, torch.zeros(8, 32))), "has shape"),
    "rank above 64": (_edit_config(r=128), "rank r must be"),
    "rank not matching the tensors": (_edit_config(r=4), "has shape"),
    "rank zero": (_edit_config(r=0), "rank r must be"),
    "truncated weights": (_truncate, "cannot be read"),
    "corrupt config": (lambda d: (d / CONFIG).write_text("{not json"), "cannot be read as JSON"),
    "unknown target": (_edit_config(target_modules=["q_proj", "lm_head"]), "unknown target modules"),
    "regex targets": (_edit_config(target_modules=".*proj"), "must be a list"),
    "dora": (_edit_config(use_dora=True), "use_dora"),
    "bias": (_edit_config(bias="all"), "bias"),
    "missing tensor": (_edit_weights(lambda sd: sd.pop(Q0_A)), "lacks lora_A"),
    "stray tensor": (_edit_weights(lambda sd: sd.__setitem__("base_model.model.lm_head.lora_A.weight",
                                                             torch.zeros(8, 64))), "unexpected tensor"),
    "not finite": (_edit_weights(lambda sd: sd[Q0_A].__setitem__((0, 0), float("nan"))), "not finite"),
    "no weights": (lambda d: (d / WEIGHTS).unlink(), "cannot be read"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_adapter_is_refused_and_nothing_loads(hf: Any, good: Path, tmp_path: Path, case: str) -> None:
    breaks, message = CASES[case]
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    breaks(bad)
    base = LlamaConfig.from_hf(hf.config.to_dict())
    with pytest.raises(ValueError, match=message):
        load_adapter(bad, "bad", base)
    reg = LoraRegistry(tmp_path, base, 4)
    assert reg.acquire("bad") is False  # pinned; its load runs beside the engine
    for _ in range(1000):
        if not reg.loads_in_flight:
            break
        time.sleep(0.01)
    why = reg.settle("bad")
    assert isinstance(why, str) and re.search(message, why), why
    assert reg.resident == [] and reg.loads == 0 and reg.loading == []  # nothing kept: a later request retries


def test_the_engine_refuses_a_bad_adapter_per_request(hf: Any, good: Path, tmp_path: Path) -> None:
    shutil.copytree(good, tmp_path / "ok")
    shutil.copytree(good, tmp_path / "bad")
    _truncate(tmp_path / "bad")
    eng = lora_engine(hf, tmp_path)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.add_request("bad", [5, 6, 7], params, lora="bad")
    eng.add_request("ok", [5, 6, 7], params, lora="ok")
    outs: dict[str, list[Any]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["bad"][0].error_code == "invalid_request" and "cannot be loaded" in outs["bad"][0].error
    assert sum(len(o.new_token_ids) for o in outs["ok"]) == 3
    assert eng.loras is not None and eng.loras.resident == ["ok"]


def test_a_shape_for_another_base_model_is_refused(good: Path) -> None:
    other = LlamaConfig.from_hf(hf_model(seed=0, hidden_size=96).config.to_dict())
    with pytest.raises(ValueError, match="the base model needs"):
        load_adapter(good, "a", other)
