"""The pure parts of generate's hardening, without a server: Retry-After read and capped, secrets
redacted, text that is not UTF-8 found, the run's verdict on too few rows, ids typed, run ids checked
to their last character."""
import sys

import pytest

from tests.helpers.generate_cli import ROOT

sys.path.insert(0, str(ROOT / "remote"))

from datasets_io import RowError, given_id, row_id  # noqa: E402
from endpoints import RETRY_AFTER_CAP_S, retry_after_s  # noqa: E402
from run_files import Unwritable, bad_text_at, record_bytes  # noqa: E402
from script import Secrets  # noqa: E402


@pytest.mark.parametrize("headers, seconds", [
    ({"retry-after": "7"}, 7.0),
    ({"retry-after": " 2.5 "}, 2.5),
    ({"retry-after": "3600"}, RETRY_AFTER_CAP_S),
    ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
    ({"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, 10.0),  # now is 07:28:00
    ({"retry-after": "Wed, 21 Oct 2015 07:27:00 GMT"}, 0.0),  # already past
    ({"retry-after": "soon"}, None), ({"retry-after": "-4"}, None), ({"retry-after-ms": "nan"}, None),
    ({}, None),
])
def test_retry_after_is_read_as_seconds_or_a_date_and_capped(headers, seconds):
    assert retry_after_s(headers, now=1445412480.0) == seconds


def test_secrets_are_redacted_by_name_longest_first_and_short_values_ignored():
    secrets = Secrets({"VLLM_API_KEY": "sk-abcdef123456", "HF_TOKEN": "hf_tok_sk-abcdef123456_x",
                       "MY_KEY": "short"}, names=("MY_KEY",))
    text = "key sk-abcdef123456, token hf_tok_sk-abcdef123456_x, short"
    assert secrets.redact(text) == "key <VLLM_API_KEY>, token <HF_TOKEN>, short"
    assert secrets.found_in("...sk-abcdef123456...") == "VLLM_API_KEY"
    assert secrets.found_in("nothing here") is None


def test_a_record_with_a_lone_surrogate_or_a_secret_is_unwritable_naming_where():
    record = {"id": "a", "messages": [{"role": "user", "content": "ok"},
                                      {"role": "assistant", "content": "bad \ud800"}]}
    with pytest.raises(Unwritable, match=r"^messages\[1\]\.content is not valid UTF-8"):
        record_bytes(record)
    assert bad_text_at({"x": ["fine", {"k\udfff": 1}]}) == "a key of x[1]"
    assert bad_text_at({"x": "fine \U0001f600"}) is None  # a real pair is fine
    secrets = Secrets({"VLLM_API_KEY": "sk-abcdef123456"})
    with pytest.raises(Unwritable, match="carries a known secret .<VLLM_API_KEY>."):
        record_bytes({"id": "a", "content": "echo sk-abcdef123456"}, secrets)
    assert record_bytes({"id": "é"}) == '{"id":"é"}\n'.encode()


@pytest.mark.parametrize("given, expected", [
    ("5", "5"), (5, 5), ("", None), (None, None), (5.0, RowError), (True, RowError), ([5], RowError),
    ({"a": 1}, RowError)])
def test_an_id_is_a_string_or_an_integer(given, expected):
    row = {"id": given, "prompt": "Q"}
    if expected is RowError:
        with pytest.raises(RowError, match="not a string or an integer"):
            given_id(row)
        assert row_id(row).startswith("sha256:")  # its error still has a stable name
    else:
        assert given_id(row) == expected


def test_failure_line_names_the_commonest_error_and_respects_the_share():
    sys.argv = ["generate.py"]
    from generate import Stats

    stats = Stats(10)
    assert stats.failure(0.5) is None  # nothing settled: nothing failed
    stats.completed, stats.errors, stats.malformed = 4, 5, 1
    for n in (612, 700, 650):
        stats.failed_row(f"HTTP 400: you requested {n} tokens")
    stats.failed_row("HTTP 404: no such model")
    stats.failed_row("timeout")
    stats.failed_row("timeout")
    assert stats.failure(0.4) is None
    line = stats.failure(0.5)
    assert line == ("only 4 of 10 rows succeeded (less than --min-success 0.5); commonest error (3 rows): "
                    "HTTP 400: you requested 612 tokens")
    assert stats.commonest_error() == {"error": "HTTP 400: you requested 612 tokens", "rows": 3}
    stats.completed = 0
    assert stats.failure(0.0) is None and stats.failure(0.01).startswith("only 0 of 6 rows")


@pytest.mark.parametrize("run_id", ["gen-1\n", "gen-1\n\n", "\ngen-1", "gen 1", "gen-1\r"])
def test_a_run_id_with_a_line_break_is_not_a_run_id(run_id):
    from specops import jobs, runs
    from specops.errors import SpecopsError

    assert not jobs.is_run_id(run_id)
    with pytest.raises(SpecopsError, match="use letters, digits"):
        runs.check_run_id(run_id)
    assert jobs.is_run_id("gen-1")


def test_the_run_wrapper_keeps_every_file_of_the_run_private(tmp_path):
    import os
    import stat
    import subprocess

    (tmp_path / "cmd").write_text("echo made >out.txt\n")
    env = tmp_path / "vllm.env"
    env.write_text("")
    old = os.umask(0o022)  # a permissive tmux server's, as the wrapper may inherit
    try:
        subprocess.run(["bash", str(ROOT / "remote" / "run.sh"), str(tmp_path), sys.executable, str(env)],
                       check=True, timeout=120)
    finally:
        os.umask(old)
    for name in ("out.txt", "log", "exit_code", "manifest.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
