"""Batched sampling over the rows the model produced logits for.

Order of operations (as vLLM): raw logprobs are taken from the model's logits; then penalties and logit_bias,
then the min_tokens mask; greedy rows take the argmax; random rows are scaled by temperature, filtered by top-k, top-p
and min-p, and sampled by the exponential race argmax(p / q), q ~ Exp(1). A request with a seed draws q from
its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from workers.core.outputs import SampledToken, TokenLogprobs
from workers.core.request import Request


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # (S, V) -> (S,) int64
    """torch.argmax(logits, dim=-1), through the CPU kernel (fused_ops.cpp: the same indices, NaN first, then the
    first maximum) for fp32 CPU rows: torch's reduction took ~3% of a 32-row decode step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0 \
            and logits.stride(1) == 1:
        from kernels_cupy.cpu.fused import load_fused

        mod = load_fused()
        if mod is not None:
            out: torch.Tensor = mod.argmax_rows(logits)
            return out
    return torch.argmax(logits, dim=-1)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}  # request id -> its seeded generator

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        # logits: (S, V) fp32, row i belongs to reqs[i]
        want_lp = [r.params.logprobs for r in reqs]
        raw_lp = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_lp) else None
        logits = self.process(logits, reqs)
        tokens = argmax_rows(logits)  # (S,) greedy for every row, random rows overwritten
        rand_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand_rows:
            tokens[rand_rows] = self._sample_random(logits[rand_rows], [reqs[i] for i in rand_rows])
        ids = tokens.tolist()
        return [SampledToken(t, token_logprobs(raw_lp[i], t, n) if raw_lp is not None and n is not None else None)
                for i, (t, n) in enumerate(zip(ids, want_lp))]

    def process(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Penalties, then the min_tokens mask: the logits greedy rows take the argmax of."""
        return self._mask_early_stop(self._penalize(logits, reqs), reqs)

    def _penalize(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p, r = reqs[i].params, reqs[i]
            if p.repetition_penalty != 1.0:  # HF/vLLM style, over prompt and output tokens
                seen = torch.tensor(sorted(set(r.all_token_ids)), device=logits.device)
                v = logits[i, seen]
                logits[i, seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
            if r.output_token_ids and (p.presence_penalty or p.frequency_penalty):  # OpenAI style, output only
                counts = torch.bincount(torch.tensor(r.output_token_ids, device=logits.device),
                                        minlength=self.vocab_size)[: self.vocab_size].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if p.logit_bias:  # OpenAI's: added to the logits (ids past the vocabulary were refused upstream)
                ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
                logits[i, ids] += torch.tensor([b for _, b in p.logit_bias], device=logits.device,
                                               dtype=logits.dtype)
        return logits

    @staticmethod
    def _mask_early_stop(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Before min_tokens, EOS (unless ignored) and stop ids cannot be sampled."""
        masked = logits
        for i, r in enumerate(reqs):
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
                if banned:
                    if masked is logits:
                        masked = logits.clone()  # never write into the caller's tensor
                    masked[i, sorted(banned)] = float("-inf")
        return masked

    def _sample_random(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        # logits: (R, V) -> (R,) token ids
        return self.race(self.random_probs(logits, reqs), reqs)

    def random_probs(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """(R, V) penalized logits of random rows -> the (R, V) distribution they are sampled from (after
        temperature, top-k, top-p and min-p; not renormalized after min-p: the race does not need it)."""
        temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)[:, None]
        logits = logits / temps
        logits = self._top_k_top_p(logits, reqs)
        probs = torch.softmax(logits, dim=-1)  # (R, V)
        min_p = torch.tensor([r.params.min_p for r in reqs], device=logits.device)[:, None]
        if bool((min_p > 0).any()):
            probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
        return probs

    def race(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One draw per row from (unnormalized) ``probs``: the exponential race argmax(p / q), q ~ Exp(1)."""
        q = torch.empty_like(probs)
        for i, r in enumerate(reqs):
            q[i].exponential_(generator=self._generator_for(r))
        return torch.argmax(probs / q, dim=-1)

    def uniform(self, r: Request) -> float:
        """A U[0, 1) draw from the request's generator (speculative decoding's accept test)."""
        return float(torch.rand((), generator=self._generator_for(r), device=self.device))

    def _generator_for(self, r: Request) -> torch.Generator:
        if r.params.seed is None:
            return self._shared
        g = self._generators.get(r.request_id)
        if g is None:
            g = self._generators[r.request_id] = torch.Generator(device=self.device).manual_seed(r.params.seed)
        return g

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        ks = [r.params.top_k if r.params.top_k > 0 else logits.shape[-1] for r in reqs]
        ps = [r.params.top_p for r in reqs]
        if all(k >= logits.shape[-1] for k in ks) and all(p >= 1.0 for p in ps):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
        rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        drop = rank >= torch.tensor(ks, device=logits.device)[:, None]  # top-k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # top-p: drop a token when the mass strictly before it already reaches p (the top token always stays)
        before = probs.cumsum(dim=-1) - probs
        drop |= before >= torch.tensor(ps, device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def token_logprobs(row_lp: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    # row_lp: (V,) log-probabilities of the model's raw distribution
    top: list[tuple[int, float]] = []
    if n > 0:
        vals, idx = row_lp.topk(n)
        top = list(zip(idx.tolist(), vals.tolist()))
    return float(row_lp[token]), top
