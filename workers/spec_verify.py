"""Speculative decoding, the torch half: turn the logits of a step into tokens, verifying drafts.

A request with a draft d_1..d_k has k + 1 logits rows (its last token's and each draft token's). Row j is
processed exactly as the sampler would process the request's next row if d_1..d_j had been sampled before it
(penalties and the min_tokens mask see them as output). Then, walking j = 0..k-1:
  greedy: accept d_{j+1} while it is the argmax; at the first mismatch emit the argmax and stop;
  sampled: accept d_{j+1} with probability p_j(d_{j+1}) (u ~ U[0,1) from the request's generator); on a
    rejection emit a draw from p_j with d_{j+1} removed (renormalized) and stop.
After k acceptances the model's own token from row k (the bonus) is emitted. For a draft that is a point mass,
this is the standard speculative-sampling rule (accept with min(1, p/q) = p(d), resample from max(0, p - q)),
so every emitted token is distributed exactly as without speculation. Logprobs (of the raw distribution, as
the sampler reports them) come from the emitted token's row. Requests without a draft go through the sampler
unchanged, so their tokens are the sampler's own.
"""

from __future__ import annotations

import dataclasses

import torch

from workers.core.outputs import Sampled, SampledToken, ScheduledRequest
from workers.core.request import Request
from workers.sampler import Sampler, token_logprobs


def sample_step(sampler: Sampler, logits: torch.Tensor, sampled: list[ScheduledRequest]) -> dict[str, Sampled]:
    """``logits``: one row per sampled request, k + 1 consecutive rows for a request with a k-token draft."""
    if not any(s.spec_token_ids for s in sampled):
        tokens = sampler.sample(logits, [s.request for s in sampled])
        return {s.request.request_id: t for s, t in zip(sampled, tokens)}
    plain_rows: list[int] = []
    drafted: list[tuple[ScheduledRequest, int]] = []
    row = 0
    for s in sampled:
        if s.spec_token_ids:
            drafted.append((s, row))
            row += len(s.spec_token_ids) + 1
        else:
            plain_rows.append(row)
            row += 1
    out: dict[str, Sampled] = {}
    if plain_rows:
        plain = [s for s in sampled if not s.spec_token_ids]
        tokens = sampler.sample(logits[plain_rows], [s.request for s in plain])
        out.update((s.request.request_id, t) for s, t in zip(plain, tokens))
    for s, first in drafted:
        k = len(s.spec_token_ids)
        out[s.request.request_id] = verify(sampler, logits[first:first + k + 1], s.request, list(s.spec_token_ids))
    return out


def _views(req: Request, draft: list[int]) -> list[Request]:
    """The request as the sampler would see it at each of the k + 1 rows: d_1..d_j already in its output.
    Only penalties and min_tokens read the output, so other requests share the one object."""
    p = req.params
    if not p.has_penalties and len(req.output_token_ids) >= p.min_tokens:
        return [req] * (len(draft) + 1)
    return [dataclasses.replace(req, output_token_ids=req.output_token_ids + draft[:j]) for j in range(len(draft) + 1)]


@torch.inference_mode()
def verify(sampler: Sampler, logits: torch.Tensor, req: Request, draft: list[int]) -> list[SampledToken]:
    """(k + 1, V) logits of one request -> the accepted draft tokens and the model's own token after them."""
    views = _views(req, draft)
    n_lp = req.params.logprobs
    raw_lp = torch.log_softmax(logits, dim=-1) if n_lp is not None else None
    processed = sampler.process(logits, views)

    def token(j: int, t: int) -> SampledToken:
        return SampledToken(t, token_logprobs(raw_lp[j], t, n_lp) if raw_lp is not None and n_lp is not None else None)

    out: list[SampledToken] = []
    if req.params.greedy:
        best = torch.argmax(processed, dim=-1).tolist()
        for j, d in enumerate(draft):
            if best[j] != d:
                return out + [token(j, best[j])]
            out.append(token(j, d))
        return out + [token(len(draft), best[-1])]
    probs = sampler.random_probs(processed, views)
    probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalized
    for j, d in enumerate(draft):
        if sampler.uniform(req) >= float(probs[j, d]):
            residual = probs[j].clone()
            residual[d] = 0.0
            t = int(sampler.race(residual[None, :], [req])[0])
            return out + [token(j, t)]
        out.append(token(j, d))
    return out + [token(len(draft), int(sampler.race(probs[-1:], [req])[0]))]
