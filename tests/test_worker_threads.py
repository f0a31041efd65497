"""`--num-threads`: `kvgate serve` forwards it to its local workers, and both sides refuse less than 1."""

from __future__ import annotations

import argparse

import pytest

from gateway.config import EngineArgs


def test_threads_are_forwarded_and_validated() -> None:
    assert EngineArgs(num_threads=3).argv()[-2:] == ["--num-threads", "3"]
    assert "--num-threads" not in EngineArgs().argv()
    with pytest.raises(ValueError, match="num-threads"):
        EngineArgs(num_threads=0)


def test_worker_rejects_zero_threads() -> None:
    from workers.process.worker_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--num-threads", "2"])).model.num_threads == 2
    with pytest.raises(ValueError, match="--num-threads"):
        engine_config(p.parse_args(["--num-threads", "0"]))
