"""The quality gate of issue 29's goal 2 for an OpenVINO IR: perplexity over the shipped text
(bench/data/quality_text.txt, bench/quality.py's method) and the top-1 agreement of every position's argmax with
kvgate's ``none`` (fp32 of the GGUF's own weights), beside kvgate's ``auto``. Run it before comparing an
OpenVINO configuration's speed with kvgate's (bench/peer_openvino.py): a peer is only a peer at the same quality.

Why: OpenVINO cannot run the GGUF's Q4_1 blocks. An int4 export re-quantizes the de-quantized weights (NNCF, integer
zero points, groups of 64-128 by default), a second rounding on top of the GGUF's. On smollm2 that export scored
perplexity 33.8 against 21.06 and agreed with ``none`` on 60% of positions (bench/RESULTS.md, twenty-fourth session).

    .venv/bin/python bench/openvino_quality.py --ov-model DIR [--ov-precision f32] [--ov-property KEY=VALUE ...]

The IR is run once over the whole text (OVModelForCausalLM in the OpenVINO venv, a process of its own, KV cache in
f32 so only the weights and the inference precision differ); kvgate's modes run as bench/quality.py runs them
(prefill chunks of 256). Exports: bench/peer_openvino.py's docstring (``--weight-format int4|int8|fp16``).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_openvino import add_ov_args, check_ov_args, run_openvino  # noqa: E402
from quality import mode_model, text_ids  # noqa: E402

from workers.engine_build import default_backend  # noqa: E402
from workers.models.scoring import sequence_logits  # noqa: E402

# Run in the OpenVINO venv: the IR's logits over the ids in one pass -> perplexity and argmax per position.
_OV = r"""
import json, math, sys
import torch, torch.nn.functional as F
from optimum.intel import OVModelForCausalLM
a = json.loads(sys.stdin.readline())
ids = a["ids"]
m = OVModelForCausalLM.from_pretrained(a["model"], ov_config=a["props"], compile=True)
with torch.no_grad():
    out = m(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
logits = out.logits[0, :-1].float()  # (n - 1, vocab)
ppl = math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())
print("@@" + json.dumps({"perplexity": ppl, "top1": logits.argmax(-1).tolist()}), flush=True)
"""


def openvino_scores(python: str, model: str, props: dict[str, str], ids: list[int]) -> tuple[float, torch.Tensor]:
    """(perplexity, argmax per position) of the IR under these CPU plugin properties."""
    with tempfile.NamedTemporaryFile("w+", prefix="openvino-quality-", suffix=".log") as log:
        r = run_openvino(python, {"model": model, "props": props, "ids": ids}, log, script=_OV)
    return float(r["perplexity"]), torch.tensor(r["top1"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_ov_args(ap)
    ap.add_argument("--modes", default="auto", help="kvgate modes to score beside `none` (comma-separated)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    check_ov_args(a)
    torch.set_num_threads(a.threads)
    ids = text_ids("smollm2")
    target = torch.tensor(ids[1:])
    rows: list[tuple[str, float, float]] = []
    base: torch.Tensor | None = None
    for mode in ["none", *[m for m in a.modes.split(",") if m and m != "none"]]:
        logits = sequence_logits(mode_model("smollm2", mode, len(ids) + 1), ids, default_backend(torch.device("cpu")),
                                 chunk=256, kv_dtype=torch.float32)[:-1]
        top1 = logits.argmax(-1)
        base = top1 if base is None else base
        rows.append((f"kvgate `{mode}`", math.exp(F.cross_entropy(logits, target).item()),
                     (top1 == base).float().mean().item()))
    assert base is not None
    props = {"INFERENCE_NUM_THREADS": str(a.threads), "KV_CACHE_PRECISION": "f32",
             **({"INFERENCE_PRECISION_HINT": a.ov_precision} if a.ov_precision != "default" else {}),
             **dict(kv.split("=", 1) for kv in a.ov_property)}
    ppl, top1 = openvino_scores(a.ov_python, a.ov_model, props, ids)
    shown = ", ".join(f"{k}={v}" for k, v in props.items() if k != "INFERENCE_NUM_THREADS")
    rows.append((f"OpenVINO {a.ov_model} ({shown})", ppl, (top1 == base).float().mean().item()))
    print(f"{len(ids)} tokens of {Path('bench/data/quality_text.txt')}; goal 2: top-1 agreement >= 99%, "
          "perplexity within 0.2% of `none`\n")
    print("| model | perplexity | vs `none` | top-1 agreement with `none` |")
    print("|---|---:|---:|---:|")
    for name, p, agree in rows:
        print(f"| {name} | {p:.4f} | {p / rows[0][1] - 1:+.2%} | {agree:.2%} |")


if __name__ == "__main__":
    main()
