"""Start-up: the engine's warm-up leaves no trace a client or a metric could see, and each long step shows
progress (a spinner then a tick on a terminal, log lines elsewhere)."""

from __future__ import annotations

import io
import logging
import re

import pytest

from tests.tiny import hf_model, tiny_engine
from workers.core.sampling_params import SamplingParams
from common.startup import StartupProgress


def test_warm_up_runs_prefill_and_decode_then_leaves_the_engine_as_new() -> None:
    hf = hf_model()
    engine = tiny_engine(hf, block_size=16)
    free_before = engine.scheduler.bm.num_free_blocks
    engine.warm_up()
    assert engine.scheduler.generation_tokens_total == 0 and engine.scheduler.prompt_tokens_total == 0
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.prefix_queries, s.prefix_hits, s.num_preemptions) == (0, 0, 0, 0, 0)
    assert engine.scheduler.bm.num_free_blocks == free_before  # its blocks came back, none stays cached
    # A real request afterwards gets the same tokens as on an engine that never warmed up.
    cold = tiny_engine(hf, block_size=16)
    outs = []
    for e in (engine, cold):
        e.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        toks: list[int] = []
        while e.has_unfinished():
            toks += [t for o in e.step() for t in o.new_token_ids]
        outs.append(toks)
    assert outs[0] == outs[1] and len(outs[0]) == 6


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_ticks_each_step() -> None:
    out = _Tty()
    p = StartupProgress("worker w0", out)
    with p.step("loading weights"):
        pass
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # without colours and cursor moves
    assert "worker w0: loading weights..." in shown  # the spinner's line while it runs
    assert re.search(r"✓ worker w0: loading weights \(\d+\.\ds\)\n$", shown), shown


def test_progress_elsewhere_logs_start_and_duration_and_no_tick_on_failure(caplog: pytest.LogCaptureFixture,
                                                                            ) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.startup")
    p = StartupProgress("worker w0", io.StringIO())
    with p.step("warming up"):
        pass
    with pytest.raises(RuntimeError), p.step("allocating"):
        raise RuntimeError("out of memory")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "worker w0: warming up..." and msgs[1].startswith("worker w0: warming up done in ")
    assert msgs[2:] == ["worker w0: allocating..."]  # a failed step never claims to be done
