"""Grammar engines for structured outputs, measured on this CPU with smollm2's tokenizer (vocab 49152).

For each engine (xgrammar, llguidance, outlines-core): compile time of a moderate JSON schema (cold), then the
per-token cost of computing the allowed-token mask while walking a valid instance token by token, with 1 and 16
matchers per step (16 requests in a batch: the masks are filled one after another, as a 2-core host would), and
the cost of applying a mask to a (16, 49152) fp32 logits tensor. One invocation measures all, so ratios compare.

    .venv/bin/python bench/structured_engines.py [--engines xgrammar,llguidance,outlines]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 49152
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"},
            "country": {"type": "string"}}, "required": ["street", "city", "country"],
            "additionalProperties": False},
        "phones": {"type": "array", "items": {"type": "object", "properties": {
            "kind": {"enum": ["home", "work", "mobile"]}, "number": {"type": "string"}},
            "required": ["kind", "number"], "additionalProperties": False}},
    },
    "required": ["name", "age", "email", "active", "role", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "active": True, "role": "admin",
            "score": 9.75, "tags": ["math", "engines", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "country": "UK"},
            "phones": [{"kind": "home", "number": "+44 20 7946 0000"}]}


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from workers.model_files import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2").directory)


class Engine:
    """compile() -> grammar; matcher(grammar) -> m; fill(m, mask, row); accept(m, token)."""

    name = ""
    version = ""

    def compile(self, schema: str) -> Any: ...
    def matcher(self, grammar: Any) -> Any: ...
    def alloc(self, n: int) -> Any: ...
    def fill(self, m: Any, mask: Any, row: int) -> None: ...
    def accept(self, m: Any, token: int) -> None: ...
    def apply(self, logits: Any, mask: Any) -> None: ...


class Xgrammar(Engine):
    def __init__(self, tok: Any) -> None:
        import importlib.metadata

        import xgrammar as xgr

        self.xgr, self.name = xgr, "xgrammar"
        self.version = importlib.metadata.version("xgrammar")
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def matcher(self, grammar: Any) -> Any:
        return self.xgr.GrammarMatcher(grammar)

    def alloc(self, n: int) -> Any:
        return self.xgr.allocate_token_bitmask(n, VOCAB)

    def fill(self, m: Any, mask: Any, row: int) -> None:
        m.fill_next_token_bitmask(mask, row)

    def accept(self, m: Any, token: int) -> None:
        if not m.accept_token(token):
            raise RuntimeError("xgrammar rejected a token of the instance")

    def apply(self, logits: Any, mask: Any) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, mask)


class Llguidance(Engine):
    def __init__(self, tok: Any) -> None:
        import importlib.metadata

        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.name, self.version = "llguidance", importlib.metadata.version("llguidance")
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)

    def compile(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, grammar)  # llguidance builds its parser here (lazy lexer)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return grammar

    def matcher(self, grammar: Any) -> Any:
        return self.llg.LLMatcher(self.tok, grammar)

    def alloc(self, n: int) -> Any:
        return self.lt.allocate_token_bitmask(n, VOCAB)

    def fill(self, m: Any, mask: Any, row: int) -> None:
        self.lt.fill_next_token_bitmask(m, mask, row)

    def accept(self, m: Any, token: int) -> None:
        if not m.consume_token(token):
            raise RuntimeError(f"llguidance rejected a token: {m.get_error()}")

    def apply(self, logits: Any, mask: Any) -> None:
        self.lt.apply_token_bitmask_inplace(logits, mask)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character map (byte-level BPE vocabularies are written in it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class OutlinesCore(Engine):
    """outlines-core walks a regex DFA built over the whole vocabulary at compile time; its vocabulary wants
    decoded token strings, built here from the HF tokenizer (byte-level BPE: GPT-2's byte map undone)."""

    def __init__(self, tok: Any) -> None:
        import importlib.metadata

        import outlines_core

        self.oc, self.name = outlines_core, "outlines-core"
        self.version = importlib.metadata.version("outlines_core")
        dec = {v: k for k, v in _bytes_to_unicode().items()}
        eos = tok.eos_token_id
        tokens: dict[Any, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i == eos or i >= VOCAB:
                continue
            raw = bytes(dec[c] for c in text) if all(c in dec for c in text) else text.encode()
            tokens.setdefault(raw, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, tokens)

    def compile(self, schema: str) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        return self.oc.Index(build_regex_from_schema(schema), self.vocab)

    def matcher(self, grammar: Any) -> Any:
        return self.oc.Guide(grammar)

    def alloc(self, n: int) -> Any:
        import torch

        return torch.zeros((n, (VOCAB + 31) // 32), dtype=torch.int32)

    def fill(self, m: Any, mask: Any, row: int) -> None:
        m.write_mask_into(mask[row].data_ptr(), mask[row].numel(), mask.element_size())

    def accept(self, m: Any, token: int) -> None:
        m.advance(token)

    def apply(self, logits: Any, mask: Any) -> None:
        import xgrammar  # outlines-core has no apply kernel; the same packed bitmask layout

        xgrammar.apply_token_bitmask_inplace(logits, mask)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(engine: Engine, ids: list[int], batch: int) -> dict[str, float]:
    import torch

    schema = json.dumps(SCHEMA)
    compile_s, grammar = _timed(lambda: engine.compile(schema))
    matchers = [engine.matcher(grammar) for _ in range(batch)]
    mask = engine.alloc(batch)
    per_step: list[float] = []
    for t in ids:
        t0 = time.perf_counter()
        for row, m in enumerate(matchers):
            engine.fill(m, mask, row)
        per_step.append(time.perf_counter() - t0)
        for m in matchers:
            engine.accept(m, t)
    logits = torch.randn(batch, VOCAB)
    apply_s = min(_timed(lambda: engine.apply(logits, mask))[0] for _ in range(20))
    return {"compile_ms": compile_s * 1e3, "mask_step_us_mean": statistics.fmean(per_step) * 1e6,
            "mask_step_us_p50": statistics.median(per_step) * 1e6,
            "mask_step_us_p99": sorted(per_step)[int(len(per_step) * 0.99)] * 1e6,
            "mask_step_us_max": max(per_step) * 1e6, "apply_us": apply_s * 1e6, "tokens": len(ids)}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="xgrammar,llguidance,outlines")
    args = ap.parse_args()
    tok = tokenizer()
    ids = tok.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    makers = {"xgrammar": Xgrammar, "llguidance": Llguidance, "outlines": OutlinesCore}
    print(f"CPU: {cpu_name()}; instance: {len(ids)} tokens; torch threads: default")
    for key in args.engines.split(","):
        try:
            engine = makers[key](tok)
            for batch in (1, 16):
                r = measure(engine, ids, batch)
                print(json.dumps({"engine": engine.name, "version": engine.version, "batch": batch}
                                 | {k: round(v, 1) for k, v in r.items()}))
        except Exception as e:  # one engine failing must not hide the others' numbers
            print(json.dumps({"engine": key, "error": f"{type(e).__name__}: {e}"}))


if __name__ == "__main__":
    main()
