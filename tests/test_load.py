"""The load tool without a server: loopback only, bounded, its plan and its statistics. The run
against a served model is in tests/test_faults.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from moe_overlay.serving.load import (
    CANCEL_EVERY,
    LoadError,
    loopback_target,
    make_plans,
    percentile,
    run_load,
    tree_rss_mib,
)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000",
                                 "http://127.0.0.5:9"])
def test_loopback_targets_are_accepted(url):
    host, port = loopback_target(url)
    assert host and port in (8000, 9)


@pytest.mark.parametrize("url, words", [
    ("http://192.0.2.1:8000", "not loopback"),
    ("http://10.0.0.1", "not loopback"),
    ("http://0.0.0.0:8000", "not loopback"),
    ("https://127.0.0.1:8000", "http://HOST:PORT"),
    ("127.0.0.1:8000", "http://HOST:PORT"),
])
def test_other_targets_are_refused(url, words):
    with pytest.raises(LoadError, match=words):
        loopback_target(url)


@pytest.mark.parametrize("clients, requests", [(0, 10), (257, 10), (4, 0), (4, 10_001)])
def test_runs_are_bounded(clients, requests):
    with pytest.raises(LoadError, match="clients must be"):
        run_load("http://127.0.0.1:9", clients, requests, 10, [8], [8])


def test_the_cli_refuses_a_remote_target_before_sending_anything():
    result = subprocess.run([sys.executable, "-m", "moe_overlay.serving.load", "--url", "http://192.0.2.1:8000"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "not loopback" in result.stderr


def test_plans_mix_lengths_and_cancel_a_tenth():
    plans = make_plans(500, [8, 64, 256], [8, 32, 128], seed=0)
    assert sum(p.cancel for p in plans) == 500 // CANCEL_EVERY
    assert {len(p.prompt) for p in plans} == {8, 64, 256} and {p.max_tokens for p in plans} == {8, 32, 128}
    assert plans == make_plans(500, [8, 64, 256], [8, 32, 128], seed=0)  # reproducible


def test_nearest_rank_percentiles():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_memory_of_a_process_tree_counts_children():
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 * 2**20); import time; time.sleep(30)"])
    try:
        own = None
        for _ in range(100):  # until the child has its 200 MiB
            if (own := tree_rss_mib(child.pid)) and own > 200:
                break
            time.sleep(0.1)
        assert own and own > 200
        assert tree_rss_mib(os.getpid()) > own  # this process and its child
    finally:
        child.kill()
        child.wait()
