"""Turns a scheduler plan into flat model inputs, runs the model over the paged KV cache, and samples.

Batch layout of a step (T tokens, B sequences, S sampled rows): sequences with a single new token (decodes)
first, then prefill chunks, all concatenated with no padding. Rows of requests with a LoRA adapter are grouped
per adapter (``workers.lora.LoraBatch``) and get its deltas on the projections it targets; such a step runs
eagerly (no CUDA graph), on the CPU inside the C++ decode stack where it can (workers/models/decode_stack.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kernels_cupy.interface import AttentionBackend, AttentionMetadata
from kernels_cupy.kv_quant import row_bytes, row_width
from workers import spec_verify
from workers.cuda_graphs import DecodeGraphs, is_pure_decode
from workers.lora import LoraBatch, LoraRegistry
from workers.core.outputs import PromptLogprob, RunnerOutput, ScheduledRequest, SchedulerOutput
from workers.models.llama import LlamaForCausalLM
from workers.sampler import Sampler
from workers.structured import StructuredOutputs, StructuredSampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (S + R,) int64 rows of the flat batch: S sampled, then R prompt-logprob rows
    sampled: list[ScheduledRequest]  # (S,) the requests the sampled rows belong to
    # (R,) per prompt-logprob row: its request id and the prompt token that follows its position
    prompt_targets: list[tuple[str, int]] = field(default_factory=list)
    lora_rows: dict[str, list[int]] = field(default_factory=dict)  # adapter name -> its rows of the flat batch


def kv_cache_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer, int8 scales included: what admission counts against a memory budget."""
    c = model.cfg
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * row_bytes(c.head_dim, dtype)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 backend: AttentionBackend, device: torch.device, kv_dtype: torch.dtype, seed: int = 0,
                 loras: LoraRegistry | None = None) -> None:
        c = model.cfg
        self.model, self.backend, self.device = model, backend, device
        self.block_size = block_size
        shape = (num_blocks, block_size, c.num_key_value_heads, row_width(c.head_dim, kv_dtype))
        # One K and one V tensor per layer: (NB, BS, Hkv, D), or (NB, BS, Hkv, D + 4) int8 (kernels_cupy.kv_quant)
        self.kv_caches = [(torch.zeros(shape, dtype=kv_dtype, device=device),
                           torch.zeros(shape, dtype=kv_dtype, device=device)) for _ in range(c.num_hidden_layers)]
        self.sampler = Sampler(c.vocab_size, device, seed)
        self.graphs: DecodeGraphs | None = None  # CUDA: captured decode steps (enable_cuda_graphs)
        self.loras = loras  # the engine's resident adapters (None: no lora_dir)

    def mask_with(self, outputs: StructuredOutputs) -> None:
        """Structured outputs: the sampler masks a request's logits row by its grammar, then advances it."""
        self.sampler = StructuredSampler(self.sampler, outputs)  # type: ignore[assignment]  # Sampler's API

    def enable_cuda_graphs(self, max_model_len: int, max_batch: int) -> bool:
        """Capture the decode step for batch sizes up to max_batch; False (logged) where the attention backend
        is not the CuPy one or its kernels do not cover this cache's layout (the torch reference loops over
        host-side lengths, which a graph would freeze, and writes padding rows' slot -1 out of bounds)."""
        from kernels_cupy.cupy_backend import TORCH_DTYPE_NAME, CupyAttentionBackend
        from kernels_cupy.kernels import unsupported_reason

        if not isinstance(self.backend, CupyAttentionBackend):
            log.warning("CUDA graphs need the CuPy attention kernels; every step runs eagerly")
            return False
        k = self.kv_caches[0][0]  # (NB, BS, Hkv, D)
        reason = unsupported_reason(TORCH_DTYPE_NAME.get(k.dtype, str(k.dtype)), k.shape[3], k.shape[1])
        if reason is not None:
            log.warning("CUDA graphs need the CuPy attention kernels, which do not cover this layout (%s); every "
                        "step runs eagerly", reason)
            return False
        # A graph's geometry is fixed at capture, so its attention always splits K; "invariant" does too, and is
        # kept so that a graph and an eager step give a row the same bits.
        split = "invariant" if self.backend.split == "invariant" else "always"
        backend = CupyAttentionBackend(split=split, partition_size=self.backend.partition_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, backend, self.device, max_model_len,
                                   self.block_size, max_batch)
        self.graphs.capture()
        return True

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        inputs = self.prepare(plan)
        lora = self._lora_batch(inputs.lora_rows)
        logits = None
        if self.graphs is not None and lora is None and is_pure_decode(inputs.meta, len(inputs.input_ids),
                                                                       len(inputs.logits_indices)):
            logits = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)  # (S, V), or None: eager
        if logits is None:
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend,
                                inputs.logits_indices, lora)  # (S + R, V)
        s = len(inputs.logits_indices) - len(inputs.prompt_targets)
        sampled = spec_verify.sample_step(self.sampler, logits[:s], inputs.sampled)  # drafts verified there
        if not inputs.prompt_targets:
            return RunnerOutput(sampled)
        return RunnerOutput(sampled, prompt_logprobs(logits[s:], inputs.prompt_targets, plan))

    def _lora_batch(self, lora_rows: dict[str, list[int]]) -> LoraBatch | None:
        """The step's adapter groups (every adapter was loaded and pinned when its request was added)."""
        if not lora_rows:
            return None
        if self.loras is None:
            raise RuntimeError("a step has LoRA rows but the runner has no adapters")
        kernel = None
        if self.device.type == "cpu":
            from kernels_cupy.cpu.qgemm import load_qgemm

            kernel = load_qgemm()  # flinear: the fixed-order fp32 kernel (None: torch's F.linear, logged there)
        adapters = {name: self.loras.get(name) for name in lora_rows}
        return LoraBatch.build(lora_rows, adapters, kernel, self.device)

    def prepare(self, plan: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        order = sorted(plan.scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first, stable
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        prompt_rows: list[int] = []
        targets: list[tuple[str, int]] = []
        lora_rows: dict[str, list[int]] = {}
        for s in order:
            start, n = s.request.num_computed_tokens, s.num_new_tokens
            if s.request.lora is not None:
                lora_rows.setdefault(s.request.lora, []).extend(range(len(ids), len(ids) + n))
            ids.extend(s.input_token_ids())  # with a draft: the last token, then the drafted ones
            p = range(start, start + n)
            pos.extend(p)
            table = s.block_table
            slots.extend(table[i // bs] * bs + i % bs for i in p)
            qlens.append(n)
            slens.append(start + n)
            if s.samples:  # a draft of k tokens: k + 1 rows, verified together
                logits_rows.extend(range(len(ids) - 1 - len(s.spec_token_ids), len(ids)))
                sampled.append(s)
            if s.request.needs_prompt_logprobs:  # positions up to the last but one of the prompt
                req, base = s.request, len(ids) - n
                # not those sent before a preemption: the recompute gives the same bits, already delivered
                for i in range(max(start, req.prompt_lps_sent), min(start + n, req.num_prompt_tokens - 1)):
                    prompt_rows.append(base + i - start)
                    targets.append((req.request_id, req.prompt_token_ids[i + 1]))
        max_blocks = max(-(-L // bs) for L in slens)
        tables = [s.block_table[: -(-L // bs)] for s, L in zip(order, slens)]
        bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        nd = sum(1 for q in qlens if q == 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=dev),
            block_tables=bt.to(dev), query_lens_cpu=tuple(qlens), seq_lens_cpu=tuple(slens),
            num_decodes=nd, max_seq_len=max(slens))
        return StepInputs(torch.tensor(ids, dtype=torch.int64, device=dev),
                          torch.tensor(pos, dtype=torch.int64, device=dev), meta,
                          torch.tensor(logits_rows + prompt_rows, dtype=torch.int64, device=dev), sampled, targets,
                          lora_rows)


def prompt_logprobs(logits: torch.Tensor, targets: list[tuple[str, int]],
                    plan: SchedulerOutput) -> dict[str, list[PromptLogprob]]:
    """Per request, the logprob, rank and top-N of each prompt token given the ones before it.
    logits: (R, V) fp32, row i predicting targets[i]'s token."""
    top_n = {s.request.request_id: s.request.params.prompt_logprobs or 0 for s in plan.scheduled}
    lp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    tokens = torch.tensor([t for _, t in targets], dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, tokens[:, None])  # (R, 1)
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()  # 1 = the argmax
    k = max(top_n.values())
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # (R, k)
    out: dict[str, list[PromptLogprob]] = {}
    ids, values = top_i.tolist(), top_v.tolist()  # once: a tolist per row costs more than the step's rows
    for row, ((rid, _), value, rank) in enumerate(zip(targets, chosen[:, 0].tolist(), ranks)):
        n = top_n[rid]
        out.setdefault(rid, []).append((value, rank, list(zip(ids[row][:n], values[row][:n]))))
    return out
