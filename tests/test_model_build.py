"""A worker's model build: loaded weights go into a model made on the meta device, which must not pull in
torch._dynamo (torch decomposes meta-device normal_ and arange through it: a ~2 s import in every worker's start)
nor sympy (empty_like of a meta tensor imports torch.fx's symbolic shapes: ~0.8 s),
and must come out with the loaded weights, the head tied where the config ties it, and the rope tables a model
built normally has. In a fresh process, since transformers (which makes the weights here) imports torch._dynamo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.tiny import hf_model

REPO = Path(__file__).resolve().parents[1]

_BUILD = """
import json, sys, torch
from workers.models.llama import LlamaConfig, Rotary
from workers.models.loader import build_model
cfg = LlamaConfig.from_hf(json.loads(open(sys.argv[1]).read()))
sd = torch.load(sys.argv[2])
lazy = ("torch._dynamo", "sympy")
before = any(m in sys.modules for m in lazy)
model = build_model(cfg, sd, 128, torch.float32, torch.device("cpu"))
fresh = Rotary(cfg, 128)
print(before, any(m in sys.modules for m in lazy),
      torch.equal(model.embed_tokens.weight, sd["model.embed_tokens.weight"]),
      model.lm_head.weight is model.embed_tokens.weight,
      torch.equal(model.rotary.cos, fresh.cos) and torch.equal(model.rotary.sin, fresh.sin))
"""


def test_a_loaded_model_builds_without_torch_dynamo_or_sympy(tmp_path: Path) -> None:
    hf = hf_model(tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    torch.save(dict(hf.state_dict()), tmp_path / "sd.pt")
    r = subprocess.run([sys.executable, "-c", _BUILD, str(tmp_path / "config.json"), str(tmp_path / "sd.pt")],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False", "False", "True", "True", "True"], r.stdout
