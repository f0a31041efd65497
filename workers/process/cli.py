"""Engine-side ``kvgate`` commands (``console/kvgate.py`` dispatches here): ``kvgate generate`` streams a
completion for a prompt to the terminal through the full engine in-process; ``kvgate worker`` runs one
engine replica for a gateway."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _generate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("generate", help="stream a completion for a prompt to the terminal")
    p.add_argument("prompt", help="prompt text (a user message with --chat)")
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or safetensors directory")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-tokens", type=int, default=32768)


def cmd_generate(args: argparse.Namespace) -> int:
    from workers.core.sampling_params import SamplingParams
    from common.detokenizer import IncrementalDetokenizer
    from workers.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = llm.add_request("cli-0", prompt, params)
    print(f"[model {args.model} loaded in {time.perf_counter() - t0:.1f}s; prompt {len(ids)} tokens]",
          file=sys.stderr)
    detok = IncrementalDetokenizer(llm.tokenizer)
    t1, n, reason = time.perf_counter(), 0, None
    while llm.has_unfinished():
        for o in llm.step():
            n += len(o.new_token_ids)
            sys.stdout.write(detok.add(o.new_token_ids))
            sys.stdout.flush()
            reason = o.finish_reason or reason
    dt = time.perf_counter() - t1
    print(f"\n[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tok/s, finish_reason={reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # the worker process owns its own argument parser
        from workers.process.worker import main as worker_main

        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(prog="kvgate", description="multi-tenant LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    sub.add_parser("worker", help="run one engine replica connected to a gateway (see kvgate worker -h)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(cmd_generate(args))
    except ValueError as e:  # bad input: a clear message, not a traceback
        print(f"kvgate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
