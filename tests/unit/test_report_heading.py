"""remote/report.py's heading: what is known about a run, never a placeholder where a value belongs."""
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "remote"))
import report  # noqa: E402


def test_a_launched_run_shows_its_id_host_and_start():
    meta = {"run_id": "train-20261207-101500", "host": "h200-a", "started": "2026-12-07T10:15:00+00:00"}
    title, sub = report.heading("train", "/w/runs/train-20261207-101500", meta, "2026-12-07 11:00:00 UTC")
    assert title == "train run train-20261207-101500"
    assert sub == "host h200-a · started 2026-12-07T10:15:00+00:00 · report drawn 2026-12-07 11:00:00 UTC"


def test_a_script_run_by_hand_says_where_it_was_drawn():
    for meta in ({}, {"run_id": 5, "host": None, "started": ""}):  # absent, or not what a launch writes
        title, sub = report.heading("train", "/tmp/x/run", meta, "now")
        assert title == "train run in /tmp/x/run" and "?" not in title + sub
        assert sub == f"host {socket.gethostname()} · report drawn now"
