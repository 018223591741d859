"""What `inv status` and `inv logs` show, without a host: host text made safe for a terminal, and a run
across hosts summed into one row. With real hosts: tests/host/test_watch.py."""
from specops import untrusted


def test_clean_keeps_text_and_drops_what_acts_on_a_terminal():
    assert untrusted.clean("a\tb \x1b[31mred\x1b[0m \x07\x08x\x7f") == "a\tb red x"
    assert untrusted.clean("\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\") == "link"  # OSC 8 hyperlink
    assert untrusted.clean("torn \x1b]52;c;AAAA") == "torn "  # an unterminated OSC eats the rest
    assert untrusted.clean("crlf\r") == "crlf" and untrusted.clean("\r") == ""
    assert untrusted.clean("key=abcdef ab", [("A", "ab"), ("B", "abcdef")]) == "key=<B> <A>"


def test_a_run_across_hosts_is_one_row_with_its_shards_summed():
    from specops.watch import across_hosts

    found = [("node1", {"run": "gen-1", "state": "running", "progress": {"done": 3, "total": 6, "rows_s": 1.5,
                                                                         "eta_s": 4, "stage": "generate"}}),
             ("node2", {"run": "gen-1", "state": "succeeded", "progress": {"done": 6, "total": 6, "rows_s": 2.0,
                                                                           "eta_s": 0, "stage": "done"}}),
             ("node1", {"run": "train-1", "state": "running", "progress": {"step": 5, "steps": 10, "loss": 2.5}}),
             ("node2", {"run": "train-1", "state": "running", "progress": None}),  # rank 1 prints no progress
             ("node1", {"run": "solo", "state": "succeeded", "progress": None})]
    rows = {r["run"]: r for r in across_hosts(found)}
    assert set(rows) == {"gen-1", "train-1"}  # a run on one host has its host row only
    assert rows["gen-1"]["hosts"] == 2 and rows["gen-1"]["state"] == "1 running, 1 succeeded"
    assert rows["gen-1"]["progress (all hosts)"] == "9/12 rows (75%) · 3.5 rows/s · ETA 4s"  # not "done": one host is not
    assert rows["train-1"]["state"] == "running"
    train = rows["train-1"]["progress (all hosts)"]
    assert train.startswith("step 5/10") and "loss 2.500" in train, train
