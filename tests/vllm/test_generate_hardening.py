"""remote/generate.py against what a hostile server, dataset or user sends, on the real tiny vLLM:
text that is not UTF-8, a row whose requests always break, a run where (almost) every row fails,
Retry-After, a resume with another dataset, ids of two types, and secrets echoed back.

The faults come from tests/helpers/faultproxy.py in front of the real server (its `rules` fault the
rows whose prompt carries a marker, every time). No upper bound on time is asserted: 2 shared cores.
"""
import json
import os
import stat

import pytest

from tests.helpers.faultproxy import FaultProxy
from tests.helpers.generate_cli import LEAN, generate, jsonl, ok, write_jsonl

GOOD = [{"id": f"good-{i}", "prompt": q} for i, q in enumerate(("What is 2 + 3?", "Is 9 odd?", "Spell 'cat'."))]


def ids(path):
    return sorted(r["id"] for r in jsonl(path))


def errors_by_id(out):
    return {e["id"]: e for e in jsonl(out / "errors.jsonl")}


def stats(out):
    return json.loads((out / "stats.json").read_text())


def clean(result):
    assert "Traceback" not in result.stderr, result.stderr
    return result


def write_raw(path, lines):
    """A JSONL file written as given: escapes such as \\ud800 stay escapes, as a hostile file has them."""
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ---------------------------------------------------------------- text that is not UTF-8

@pytest.mark.parametrize("rows, bad_turn", [
    ([{"id": "bad", "prompt": "SURR What is 1 + 1?"}], 0),
    ([{"id": "bad", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "x"},
                                      {"from": "human", "value": "SURR And now bye?"}]}], 1),
], ids=["first-turn", "second-turn"])
def test_a_reply_with_a_lone_surrogate_is_its_rows_error_and_resume_goes_on(vllm_server, tmp_path, rows, bad_turn):
    prompts, out = write_jsonl(tmp_path / "p.jsonl", GOOD[:2] + rows), tmp_path / "out"
    with FaultProxy(vllm_server.port, rules=[("SURR", "surrogate")]) as proxy:
        for resume in ([], ["--resume"]):
            clean(ok(generate("--endpoint", proxy.base_url, "--dataset", prompts, "--out", out,
                              "--max-retries", 1, *LEAN, *resume)))
            assert ids(out / "data.jsonl") == ["good-0", "good-1"]
            error = errors_by_id(out)["bad"]
            assert error["error"] == "malformed reply: message.content is not valid UTF-8 text (a lone surrogate)"
            assert error["attempts"] == 2 and error["turn"] == bad_turn and error["line"] == f"{prompts}:3"
            (out / "data.jsonl").read_bytes().decode("utf-8")  # strict: every byte is UTF-8
    assert proxy.injected["surrogate"] == 2 * 2


def test_dataset_text_that_is_not_utf8_is_its_rows_error_and_never_sent(vllm_server, tmp_path):
    prompts = write_raw(tmp_path / "p.jsonl", [
        json.dumps(GOOD[0]),
        '{"id": "prompt", "prompt": "What is \\ud800 plus one?"}',
        '{"id": "id-\\udfff", "prompt": "What is 5 + 5?"}',
        '{"id": "source", "source": "web\\udc80", "prompt": "What is 6 + 6?"}',
        '{"id": "system", "messages": [{"role": "system", "content": "\\ud83d"}, {"role": "user", "content": "Hi"}]}',
        json.dumps(GOOD[1]),
    ])
    out = tmp_path / "out"
    with FaultProxy(vllm_server.port) as proxy:
        for resume in ([], ["--resume"]):
            clean(ok(generate("--endpoint", proxy.base_url, "--dataset", prompts, "--out", out,
                              "--min-success", 0.3, *LEAN, *resume)))  # 2 of 6 rows are good
    assert ids(out / "data.jsonl") == ["good-0", "good-1"]
    errors = errors_by_id(out)
    assert sorted(errors) == sorted(["prompt", "id-\ufffd", "source", "system"])  # the error's id: cleaned
    assert errors["prompt"]["error"] == "messages[0].content is not valid UTF-8 text (a lone surrogate)"
    assert errors["source"]["error"] == "source is not valid UTF-8 text (a lone surrogate)"
    assert errors["id-\ufffd"]["error"] == "id is not valid UTF-8 text (a lone surrogate)"
    assert [errors[k]["line"] for k in ("prompt", "id-\ufffd", "source", "system")] == [
        f"{prompts}:{n}" for n in (2, 3, 4, 5)]
    for name in ("data.jsonl", "errors.jsonl", "stats.json"):
        (out / name).read_bytes().decode("utf-8")
    assert len(proxy.chat_bodies()) == 2  # the good rows of the first run only


# ---------------------------------------------------------------- a row that always breaks the connection

@pytest.mark.parametrize("good", [3, 0], ids=["among-good-rows", "alone"])
def test_a_row_whose_connection_always_breaks_is_its_error_and_the_run_goes_on(vllm_server, tmp_path, good):
    rows = GOOD[:good] + [{"id": "breaks", "prompt": "TRUNC What is 1 + 1?"}]
    prompts, out = write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "out"
    with FaultProxy(vllm_server.port, rules=[("TRUNC", "truncate")]) as proxy:
        for resume in ([], ["--resume"]):
            result = clean(generate("--endpoint", proxy.base_url, "--dataset", prompts, "--out", out,
                                    "--max-retries", 2, "--give-up-after", 60, *LEAN, *resume))
            assert "every endpoint has failed" not in result.stderr
            assert result.returncode == (0 if good else 4), result.stderr
            assert ids(out / "data.jsonl") == [r["id"] for r in GOOD[:good]]
            error = errors_by_id(out)["breaks"]
            assert error["error"].startswith("connection error: ") and error["attempts"] == 3, error
            assert error["line"] == f"{prompts}:{good + 1}"
    assert proxy.injected["truncate"] == 2 * 3


# ---------------------------------------------------------------- a run that produced too little

def test_every_row_refused_fails_the_run_naming_the_commonest_error(vllm_server, tmp_path):
    prompts, out = write_jsonl(tmp_path / "p.jsonl", GOOD), tmp_path / "out"
    result = clean(generate("--endpoint", vllm_server.base_url, "--model", "no-such-model", "--dataset", prompts,
                            "--out", out, *LEAN))
    assert result.returncode == 4
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("generate: only 0 of 3 rows succeeded (less than --min-success 0.5); "
                           "commonest error (3 rows): HTTP 404: "), line
    s = stats(out)
    assert s["outcome"] == "too few succeeded" and s["failure"] == line.removeprefix("generate: ")
    assert s["commonest_error"]["rows"] == 3 and s["commonest_error"]["error"].startswith("HTTP 404: ")


@pytest.mark.parametrize("min_success, code", [(None, 0), ("0.8", 4), ("0", 0)])
def test_min_success_is_the_share_of_rows_that_must_succeed(vllm_server, tmp_path, min_success, code):
    rows = GOOD + [{"id": f"refused-{i}", "prompt": f"REFUSE {i}"} for i in range(2)]
    prompts, out = write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "out"
    flag = ["--min-success", min_success] if min_success else []
    with FaultProxy(vllm_server.port, rules=[("REFUSE", "echo-auth")]) as proxy:
        result = clean(generate("--endpoint", proxy.base_url, "--dataset", prompts, "--out", out, *LEAN, *flag))
    assert result.returncode == code, result.stderr
    assert ids(out / "data.jsonl") == [r["id"] for r in GOOD]
    s = stats(out)
    assert s["commonest_error"] == {"error": s["commonest_error"]["error"], "rows": 2}
    assert s["commonest_error"]["error"].startswith("HTTP 400: ") and "bad request" in s["commonest_error"]["error"]
    if code:
        assert s["outcome"] == "too few succeeded" and s["failure"].startswith("only 3 of 5 rows succeeded")
    else:
        assert s["outcome"] == "completed" and s["failure"] is None


# ---------------------------------------------------------------- Retry-After

@pytest.mark.parametrize("status", ["429", "503"])
def test_retry_after_rests_the_endpoint_that_long(vllm_server, tmp_path, status):
    out = tmp_path / "out"
    with FaultProxy(vllm_server.port, faults={status: 1.0}, max_faults=1, retry_after="5") as proxy:
        ok(generate("--endpoint", proxy.base_url, "--dataset", write_jsonl(tmp_path / "p.jsonl", GOOD[:2]),
                    "--out", out, "--concurrency", 1, "--max-tokens", 100))
    chats = [r for r in proxy.requests if r["path"].endswith("/chat/completions")]
    assert chats[0]["fault"] == status and all(r["fault"] is None for r in chats[1:])
    assert chats[1]["at"] - chats[0]["at"] >= 4.8  # the row's own backoff alone is at most 1 s
    assert ids(out / "data.jsonl") == ["good-0", "good-1"]


def test_retry_after_rests_only_the_endpoint_that_asked(vllm_server, tmp_path):
    out = tmp_path / "out"
    with FaultProxy(vllm_server.port, rules=[("", "429")], retry_after="60") as busy, \
            FaultProxy(vllm_server.port) as free:
        ok(generate("--endpoint", busy.base_url, "--endpoint", free.base_url, "--model", "tiny", "--dataset",
                    write_jsonl(tmp_path / "p.jsonl", GOOD), "--out", out, "--concurrency", 1,
                    "--max-tokens", 100))
    assert len(busy.chat_bodies()) == 1  # asked to wait 60 s, it was not asked again during the run
    assert len(free.chat_bodies()) == len(GOOD)
    assert ids(out / "data.jsonl") == sorted(r["id"] for r in GOOD)


# ---------------------------------------------------------------- resume: the run's dataset, its ids

def test_resume_with_another_dataset_is_refused_and_without_one_reads_the_runs(vllm_server, tmp_path):
    first, other = write_jsonl(tmp_path / "p.jsonl", GOOD[:2]), write_jsonl(tmp_path / "q.jsonl", GOOD[2:])
    out = tmp_path / "out"
    base = ["--endpoint", vllm_server.base_url, "--out", out, *LEAN]
    ok(generate(*base, "--dataset", first))
    for extra in (["--dataset", other], ["--dataset", first, "--split", "test"], ["--dataset", "some/hub-set"]):
        for resume in (["--resume"], []):  # a plain re-run into the directory resumes too
            result = clean(generate(*base, *extra, *resume))
            assert result.returncode == 2
            assert result.stderr.count("\n") == 1, result.stderr
            assert f'holds a run of "{os.path.realpath(first)}" (split "train")' in result.stderr
    assert ids(out / "data.jsonl") == ["good-0", "good-1"]
    os.symlink(first, tmp_path / "link.jsonl")
    for extra in ([], ["--dataset", tmp_path / "link.jsonl"], ["--dataset", os.path.relpath(first)]):
        ok(generate(*base, "--resume", *extra))
        assert stats(out)["rows"]["done_before"] == 2 and ids(out / "data.jsonl") == ["good-0", "good-1"]


@pytest.mark.parametrize("rows, kept, refused", [
    ([{"id": 5, "prompt": "What is 5 + 5?"}, {"id": "5", "prompt": "What is 2 + 2?"},
      {"id": 6, "prompt": "What is 6 + 6?"}, {"id": 7.0, "prompt": "What is 7 + 7?"}],
     ["5", "6"], {"5": "is a string, but this run's ids are integers", "sha256": "id is float"}),
    ([{"id": "a", "prompt": "What is 1 + 1?"}, {"id": 5, "prompt": "What is 2 + 2?"},
      {"prompt": "What is 3 + 3?"}],
     ["a", "sha256"], {"5": "is an integer, but this run's ids are strings"}),
], ids=["integers-first", "strings-first"])
def test_ids_of_two_types_never_collapse(vllm_server, tmp_path, rows, kept, refused):
    prompts, out = write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "out"
    for resume in ([], ["--resume"]):
        clean(generate("--endpoint", vllm_server.base_url, "--dataset", prompts, "--out", out, *LEAN, *resume))
        assert [i.split(":")[0] for i in ids(out / "data.jsonl")] == kept
        errors = {e["id"].split(":")[0]: e["error"] for e in jsonl(out / "errors.jsonl")}
        assert sorted(errors) == sorted(refused)
        for rid, why in refused.items():
            assert why in errors[rid]
        assert stats(out)["rows"]["duplicates"] == 0
    assert json.loads((out / "input.json").read_text())["id_type"] == ("integer" if rows[0]["id"] == 5 else "string")


# ---------------------------------------------------------------- secrets, file modes

SECRET = "sk-live-0123456789abcdef"
HF = "hf_SecretTokenValue42"


def assert_nothing_holds(out, result, *secrets):
    for path in out.iterdir():
        text = path.read_bytes()
        assert not any(s.encode() in text for s in secrets), path
    assert not any(s in result.stdout + result.stderr for s in secrets)


def assert_private(out):
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_an_error_body_that_echoes_the_key_is_redacted_everywhere(vllm_server, tmp_path):
    rows = GOOD + [{"id": "echo", "prompt": "ECHO What is 1 + 1?"}]
    out = tmp_path / "out"
    env = {"MY_KEY": SECRET, "HF_TOKEN": HF}
    with FaultProxy(vllm_server.port, rules=[("ECHO", "echo-auth")]) as proxy:
        result = clean(ok(generate("--endpoint", proxy.base_url, "--api-key-env", "MY_KEY", "--dataset",
                                   write_jsonl(tmp_path / "p.jsonl", rows), "--out", out, *LEAN, env=env)))
    assert proxy.injected["echo-auth"] == 1
    assert errors_by_id(out)["echo"]["error"].endswith("bad request; you sent authorization: Bearer <MY_KEY>")
    assert_nothing_holds(out, result, SECRET, HF)
    assert_private(out)


def test_a_run_failing_on_echoed_keys_says_so_without_them(vllm_server, tmp_path):
    out = tmp_path / "out"
    with FaultProxy(vllm_server.port, rules=[("", "echo-auth")]) as proxy:
        result = clean(generate("--endpoint", proxy.base_url, "--dataset", write_jsonl(tmp_path / "p.jsonl", GOOD),
                                "--out", out, *LEAN, env={"VLLM_API_KEY": SECRET}))
    assert result.returncode == 4
    assert "commonest error (3 rows): HTTP 400: " in result.stderr
    assert result.stderr.rstrip().endswith("bad request; you sent authorization: Bearer <VLLM_API_KEY>")
    assert "<VLLM_API_KEY>" in stats(out)["failure"]
    assert_nothing_holds(out, result, SECRET)


def test_a_prompt_that_carries_a_secret_is_never_sent_and_old_files_are_narrowed(vllm_server, tmp_path):
    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    (out / "data.jsonl").write_text("")
    os.chmod(out / "data.jsonl", 0o644)
    rows = GOOD[:2] + [{"id": "leaky", "prompt": f"My token is {HF}, is it valid?"}]
    with FaultProxy(vllm_server.port) as proxy:
        result = clean(ok(generate("--endpoint", proxy.base_url, "--dataset", write_jsonl(tmp_path / "p.jsonl", rows),
                                   "--out", out, "--resume", *LEAN, env={"HF_TOKEN": HF})))
    assert errors_by_id(out)["leaky"]["error"] == "the record carries a known secret (<HF_TOKEN>); not kept"
    assert not any(HF in json.dumps(body) for body in proxy.chat_bodies())
    assert_nothing_holds(out, result, HF)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755  # a directory generate did not make keeps its mode
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
