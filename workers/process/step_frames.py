"""One engine step's outputs as ``StepOutputs`` frames of bounded size.

Prompt logprobs already travel chunk by chunk (a step's output carries only the prompt positions it computed), so a
step's outputs hold at most its token budget of them; but that budget is sized to the machine (up to 8,192 tokens,
more if the operator says so), and 8,192 positions with 20 alternatives each are ~1.9 MB of msgpack. Encoding that
holds the GIL on the engine thread (the I/O thread's heartbeats wait for it), and the gateway decodes each frame on
its event loop, where other workers' heartbeats queue behind it. So a step's outputs leave in frames of at most
``FRAME_ENTRIES`` logprob entries, a long chunk's prompt logprobs cut into consecutive outputs of the same request
(the gateway gathers them in order, as it does a prompt's chunks across steps): each encode and decode stays a few
milliseconds, whatever the budget.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from ipc.messages import PromptLogprob, RequestOutputMsg, StepOutputs

# Logprob entries (a token, a sampled or prompt token's logprob, an alternative) a frame holds: ~180 KB of msgpack,
# ~1 ms to encode here and ~7 ms to decode on the gateway. A 512-token step with 20 alternatives fits in one.
FRAME_ENTRIES: Final = 16_384


def entries(out: RequestOutputMsg) -> int:
    """What ``out`` weighs against a frame's bound (its logprob entries and tokens; 1 at least)."""
    n = 1 + len(out.new_token_ids)
    n += sum(1 + len(top) for _, top in out.logprobs or ())
    n += sum(1 + len(top) for _, _, top in out.prompt_logprobs or ())
    return n


def _prompt_only(out: RequestOutputMsg, lps: list[PromptLogprob]) -> RequestOutputMsg:
    return RequestOutputMsg(out.request_id, [], None, out.num_cached_tokens, None, None, None, prompt_logprobs=lps)


def _split(out: RequestOutputMsg, cap: int) -> list[RequestOutputMsg]:
    """``out`` as consecutive outputs of its request, each within ``cap`` (an entry or a token list bigger than
    ``cap`` alone stays whole): the leading ones carry only prompt logprobs, the last everything else."""
    lps = out.prompt_logprobs
    if not lps or entries(out) <= cap:
        return [out]
    pieces: list[RequestOutputMsg] = []
    start, weight = 0, 1
    for i, (_, _, top) in enumerate(lps):
        if weight + 1 + len(top) > cap and i > start:
            pieces.append(_prompt_only(out, lps[start:i]))
            start, weight = i, 1
        weight += 1 + len(top)
    tail: list[PromptLogprob] | None = lps[start:]
    rest = entries(replace(out, prompt_logprobs=None))
    if rest > 1 and weight - 1 + rest > cap:  # its tokens (and their logprobs) do not fit beside the last piece
        pieces.append(_prompt_only(out, lps[start:]))
        tail = None
    pieces.append(replace(out, prompt_logprobs=tail))
    return pieces


def step_frames(outputs: list[RequestOutputMsg], num_batched_tokens: int,
                cap: int = FRAME_ENTRIES) -> list[StepOutputs]:
    """The frames of one step, in order (a request's outputs stay in order); ``num_batched_tokens`` rides on the
    first, the others say 0, so the gateway counts the step once."""
    frames: list[StepOutputs] = []
    current: list[RequestOutputMsg] = []
    weight = 0
    for out in (piece for o in outputs for piece in _split(o, cap)):
        w = entries(out)
        if current and weight + w > cap:
            frames.append(StepOutputs(current, 0))
            current, weight = [], 0
        current.append(out)
        weight += w
    frames.append(StepOutputs(current, 0))
    return [replace(frames[0], num_batched_tokens=num_batched_tokens), *frames[1:]]
