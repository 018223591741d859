"""remote/generate.py, run as a subprocess against a real vLLM serving the tiny model.

Faults come from tests/helpers/faultproxy.py in front of that server; crashes are real SIGKILLs; the
restart is a real vLLM stopped and started again. No timing is asserted: 2 shared cores.
"""
import json
import random
import signal
import time

from tests.helpers.faultproxy import FaultProxy
from tests.helpers.generate_cli import (LEAN, RUN_TIMEOUT, assert_exactly_once, complete_lines, generate,
                                        jsonl, jsonl_complete, ok, prompt_rows, start_generate, user_turns,
                                        wait_for_lines, write_jsonl)
from tests.helpers.vllm_proc import free_port, start_vllm


def test_fifty_rows_every_answer_has_reasoning_and_content(vllm_server, tmp_path):
    rows = prompt_rows(50)
    out = tmp_path / "out"
    result = ok(generate("--endpoint", vllm_server.base_url, "--dataset",
                         write_jsonl(tmp_path / "p.jsonl", rows), "--out", out, *LEAN))
    records = {r["id"]: r for r in jsonl(out / "data.jsonl")}
    assert sorted(records) == sorted(r["id"] for r in rows)
    without_content = []
    for row in rows:
        record = records[row["id"]]
        answers = [m for m in record["messages"] if m["role"] == "assistant"]
        assert len(answers) == len(record["turns"])
        for m in answers:
            assert m["reasoning"] and m["reasoning"].strip(), record
            if not (m["content"] or "").strip():  # the tiny model, batched, now and then stops inside its thinking
                without_content.append(record["id"])
                continue
            assert "<think>" not in m["content"] and "</think>" not in m["content"]
        # A tiny model sometimes rambles to --max-tokens; such a row ends at that turn, marked.
        reasons = [turn["finish_reason"] for turn in record["turns"]]
        if record["truncated"]:
            assert reasons[-1] == "length" and set(reasons[:-1]) <= {"stop"}
        else:
            assert set(reasons) == {"stop"} and len(answers) == user_turns(row)
        for turn in record["turns"]:
            assert turn["usage"]["completion_tokens"] > 0
            assert turn["endpoint"] == vllm_server.base_url + "/v1"
        assert record["model"] == "tiny" and record["source"] == row["source"]
        assert record["params"] == {"max_tokens": 200}
    assert len(without_content) <= 2, without_content  # seen: 0 in most runs, 1 in one of five
    # The parser leaves the "\n\n" after </think>; it is kept as the model produced it.
    assert any((m["content"] or "").startswith("\n\n") for r in records.values() for m in r["messages"]
               if m["role"] == "assistant")
    stats = json.loads((out / "stats.json").read_text())
    assert stats["outcome"] == "completed" and stats["rows"]["completed"] == 50
    progress = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
                if line.startswith("specops-progress ")]
    assert progress[-1]["done"] == progress[-1]["total"] == 50


def test_multi_turn_regenerates_every_turn_and_sends_no_reasoning_back(vllm_server, tmp_path):
    rows = prompt_rows(4, multi_turn=True)
    rows[0]["conversations"].insert(0, {"from": "system", "value": "Answer briefly."})
    with FaultProxy(vllm_server.port) as proxy:
        ok(generate("--endpoint", proxy.base_url, "--dataset", write_jsonl(tmp_path / "p.jsonl", rows),
                    "--out", tmp_path / "out", *LEAN))
    records = {r["id"]: r for r in jsonl(tmp_path / "out" / "data.jsonl")}
    bodies = proxy.chat_bodies()
    assert len(bodies) == sum(user_turns(r) for r in rows)
    for row in rows:
        record = records[row["id"]]
        # The dataset's non-assistant messages in order, each followed by the model's own answer.
        expected_roles = []
        for turn in row["conversations"]:
            if turn["from"] == "gpt":
                expected_roles.append("assistant")
            else:
                expected_roles.append("system" if turn["from"] == "system" else "user")
        assert [m["role"] for m in record["messages"]] == expected_roles
        dataset_answers = [t["value"] for t in row["conversations"] if t["from"] == "gpt"]
        answers = [m for m in record["messages"] if m["role"] == "assistant"]
        assert all(m["reasoning"] for m in answers)
        assert [m["content"] for m in answers] != dataset_answers
        # Turn k was asked with everything before it, earlier answers as content only.
        for k, answer in enumerate(answers):
            cut = record["messages"].index(answer)
            sent = [m for m in record["messages"][:cut]]
            asked = [{"role": m["role"], "content": m["content"]} for m in sent]
            assert asked in [b["messages"] for b in bodies]
    for body in bodies:
        for m in body["messages"]:
            assert set(m) == {"role", "content"}
            assert "<think>" not in m["content"]


def test_sampling_parameters_sent_are_the_ones_recorded(vllm_server, tmp_path):
    with FaultProxy(vllm_server.port) as proxy:
        ok(generate("--endpoint", proxy.base_url, "--dataset",
                    write_jsonl(tmp_path / "p.jsonl", prompt_rows(2)), "--out", tmp_path / "out",
                    "--temperature", "0.5", "--top-p", "0.9", "--disable-thinking", *LEAN))
    params = {"max_tokens": 200, "temperature": 0.5, "top_p": 0.9,
              "chat_template_kwargs": {"enable_thinking": False}}
    for body in proxy.chat_bodies():
        assert {k: v for k, v in body.items() if k not in ("model", "messages")} == params
    assert [r["params"] for r in jsonl(tmp_path / "out" / "data.jsonl")] == [params, params]


def test_turns_first_answers_only_the_first_user_turn(vllm_server, tmp_path):
    rows = prompt_rows(3, multi_turn=True)
    ok(generate("--endpoint", vllm_server.base_url, "--dataset",
                write_jsonl(tmp_path / "p.jsonl", rows), "--out", tmp_path / "out", "--turns",
                "first", *LEAN))
    for record in jsonl(tmp_path / "out" / "data.jsonl"):
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
        assert len(record["turns"]) == 1


def test_500s_dropped_connections_and_hung_requests_every_row_once(vllm_server, tmp_path):
    rows = prompt_rows(30)
    out = tmp_path / "out"
    faults = {"500": 0.2, "drop": 0.2, "hang": 0.1}
    with FaultProxy(vllm_server.port, faults=faults, max_faults=12, seed=3) as proxy:
        ok(generate("--endpoint", proxy.base_url, "--dataset",
                    write_jsonl(tmp_path / "p.jsonl", rows), "--out", out, "--timeout", "10",
                    "--concurrency", "6", "--max-tokens", "200"))
    assert all(proxy.injected[mode] > 0 for mode in faults), proxy.injected
    assert_exactly_once(out, [r["id"] for r in rows])
    assert jsonl(out / "errors.jsonl") == []
    stats = json.loads((out / "stats.json").read_text())
    assert stats["requests"]["failed_attempts"] >= sum(proxy.injected.values())  # each was retried


def test_server_stopped_and_restarted_mid_run_completes(tiny_model, tmp_path, tmp_path_factory):
    rows = prompt_rows(40)
    out, port = tmp_path / "out", free_port()
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    logs = tmp_path_factory.mktemp("vr")  # short: vLLM's IPC socket paths live under it
    with start_vllm(tiny_model, port=port, log_path=logs / "vllm-1.log") as server:
        proc = start_generate("--endpoint", server.base_url, "--model", "tiny", "--dataset", prompts,
                              "--out", out, "--concurrency", "4", "--max-tokens", "200",
                              log=tmp_path / "generate.log")
        try:
            wait_for_lines(out / "data.jsonl", 3, proc)
        except BaseException:
            proc.kill()
            raise
    try:  # the server is gone; the generator keeps what it has and waits for it to return
        time.sleep(3)
        assert proc.poll() is None, (tmp_path / "generate.log").read_text()
        assert complete_lines(out / "data.jsonl") < len(rows)
        with start_vllm(tiny_model, port=port, log_path=logs / "vllm-2.log"):
            assert proc.wait(timeout=RUN_TIMEOUT) == 0, (tmp_path / "generate.log").read_text()
    finally:
        proc.kill()
    assert_exactly_once(out, [r["id"] for r in rows])
    assert json.loads((out / "stats.json").read_text())["requests"]["failed_attempts"] > 0


def test_kill_9_three_times_then_resume_gives_each_row_exactly_once(vllm_server, tmp_path):
    rows = prompt_rows(60)
    out, rng = tmp_path / "out", random.Random(7)
    args = ["--endpoint", vllm_server.base_url, "--dataset", write_jsonl(tmp_path / "p.jsonl", rows),
            "--out", out, "--concurrency", "4", "--max-tokens", "200"]
    for _ in range(3):
        proc = start_generate(*args, log=tmp_path / "generate.log")
        try:
            wait_for_lines(out / "data.jsonl", complete_lines(out / "data.jsonl") + rng.randint(1, 5),
                           proc)
            time.sleep(rng.uniform(0, 0.5))
            assert proc.poll() is None
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert complete_lines(out / "data.jsonl") < len(rows)
        ids = [r["id"] for r in jsonl_complete(out / "data.jsonl")]
        assert len(ids) == len(set(ids))
    ok(generate(*args, "--resume"))
    assert_exactly_once(out, [r["id"] for r in rows])


def test_interrupt_stops_cleanly_and_keeps_completed_rows(vllm_server, tmp_path):
    out, log = tmp_path / "out", tmp_path / "generate.log"
    proc = start_generate("--endpoint", vllm_server.base_url, "--dataset",
                          write_jsonl(tmp_path / "p.jsonl", prompt_rows(60)), "--out", out,
                          "--concurrency", "2", "--max-tokens", "200", log=log)
    try:
        wait_for_lines(out / "data.jsonl", 2, proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, log.read_text()
    finally:
        proc.kill()
    assert "Traceback" not in log.read_text()
    stats = json.loads((out / "stats.json").read_text())
    assert stats["outcome"] == "interrupted"
    assert stats["rows"]["done"] == len(jsonl(out / "data.jsonl")) < 60


def test_torn_last_line_is_cut_off_and_its_row_generated_again(vllm_server, tmp_path):
    rows = prompt_rows(6)
    out, prompts = tmp_path / "out", write_jsonl(tmp_path / "p.jsonl", rows)
    ok(generate("--endpoint", vllm_server.base_url, "--dataset", prompts, "--out", out, "--n", 3,
                *LEAN))
    data = out / "data.jsonl"
    last = data.read_bytes().splitlines(keepends=True)[-1]
    torn_id = json.loads(last)["id"]
    data.write_bytes(data.read_bytes()[:-len(last)] + last[:len(last) // 2])  # a crash mid-write
    result = ok(generate("--endpoint", vllm_server.base_url, "--dataset", prompts, "--out", out,
                         "--resume", *LEAN))
    assert "torn last line" in result.stderr
    assert_exactly_once(out, [r["id"] for r in rows])
    assert json.loads((out / "stats.json").read_text())["rows"]["done_before"] == 2
    assert torn_id in [r["id"] for r in jsonl(data)]


SCHEMA_ROWS = [
    {"id": "sharegpt", "conversations": [
        {"from": "system", "value": "Answer briefly."},
        {"from": "human", "value": "What is 12 + 30?"}, {"from": "gpt", "value": "DATASET-ANSWER"}]},
    {"id": "openai", "messages": [{"role": "user", "content": "Reverse the word 'apple'."}]},
    {"id": "specforge", "conversations": [{"role": "user", "content": "Spell 'dog' backwards."},
                                          {"role": "assistant", "content": "DATASET-ANSWER"}]},
    {"id": "prompt", "prompt": "Is 17 even or odd?"},
    {"prompt": "What is 4 + 4?"},
    {"id": "empty", "conversations": []},
    {"id": "not-a-string", "messages": [{"role": "user", "content": 5}]},
    {"id": "assistant-only", "conversations": [{"from": "gpt", "value": "Hello."}]},
    {"id": "unknown-role", "messages": [{"role": "tool", "content": "x"}]},
    {"id": "no-prompt", "text": "hello"},
]
SCHEMA_ERRORS = {
    "empty": "empty conversation",
    "not-a-string": "message 0 content is int, not a string",
    "assistant-only": "no user message",
    "unknown-role": 'message 0 has unknown role "tool"',
    "no-prompt": "no messages, conversations or prompt column",
}


def test_schemas_recognised_and_malformed_rows_recorded_with_reasons(vllm_server, tmp_path):
    out = tmp_path / "out"
    ok(generate("--endpoint", vllm_server.base_url, "--dataset",
                write_jsonl(tmp_path / "p.jsonl", SCHEMA_ROWS), "--out", out, *LEAN))
    records = {r["id"]: r for r in jsonl(out / "data.jsonl")}
    hashed = [i for i in records if i.startswith("sha256:")]
    assert sorted(records) == sorted(["sharegpt", "openai", "specforge", "prompt", *hashed])
    assert len(hashed) == 1
    assert [m["role"] for m in records["sharegpt"]["messages"]] == ["system", "user", "assistant"]
    assert records["sharegpt"]["messages"][-1]["content"] != "DATASET-ANSWER"
    assert records["openai"]["messages"][0] == {"role": "user",
                                                "content": "Reverse the word 'apple'."}
    assert records["prompt"]["messages"][0] == {"role": "user", "content": "Is 17 even or odd?"}
    assert records["specforge"]["messages"][0] == {"role": "user", "content": "Spell 'dog' backwards."}
    assert [m["role"] for m in records["specforge"]["messages"]] == ["user", "assistant"]
    assert records["specforge"]["messages"][-1]["content"] != "DATASET-ANSWER"
    assert {e["id"]: e["error"] for e in jsonl(out / "errors.jsonl")} == SCHEMA_ERRORS
    # The hash id is stable: a second run into a fresh directory names the row the same.
    ok(generate("--endpoint", vllm_server.base_url, "--dataset",
                write_jsonl(tmp_path / "q.jsonl", [{"prompt": "What is 4 + 4?"}]),
                "--out", tmp_path / "again", *LEAN))
    assert [r["id"] for r in jsonl(tmp_path / "again" / "data.jsonl")] == hashed


def test_parquet_input(vllm_server, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["What is 2 + 2?", "Spell 'cat' backwards."]}),
                   path)
    ok(generate("--endpoint", vllm_server.base_url, "--dataset", path, "--out", tmp_path / "out",
                *LEAN))
    assert_exactly_once(tmp_path / "out", ["a", "b"])


def test_shards_split_the_first_n_rows_between_them(vllm_server, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", prompt_rows(20))
    shards = []
    for shard in ("0/2", "1/2"):
        out = tmp_path / shard.replace("/", "-")
        ok(generate("--endpoint", vllm_server.base_url, "--dataset", prompts, "--out", out,
                    "--n", 9, "--shard", shard, "--shuffle", "--seed", 5, *LEAN))
        shards.append({r["id"] for r in jsonl(out / "data.jsonl")})
    assert len(shards[0]) == 5 and len(shards[1]) == 4 and not shards[0] & shards[1]
    # Shuffled with a buffer larger than the file, the 9 rows may come from all 20.
    assert shards[0] | shards[1] <= {r["id"] for r in prompt_rows(20)}


def test_truncated_rows_are_marked_or_dropped(vllm_server, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", prompt_rows(4))
    ok(generate("--endpoint", vllm_server.base_url, "--dataset", prompts, "--out", tmp_path / "kept",
                "--max-tokens", 3))
    for record in jsonl(tmp_path / "kept" / "data.jsonl"):
        assert record["truncated"] is True and len(record["turns"]) == 1
        assert record["turns"][0]["finish_reason"] == "length"
        assert record["messages"][-1]["reasoning"]  # cut while thinking: no answer yet
    # Every row dropped: the run produced nothing, which fails it (exit 4), naming why.
    result = generate("--endpoint", vllm_server.base_url, "--dataset", prompts, "--out",
                      tmp_path / "dropped", "--max-tokens", 3, "--drop-truncated")
    assert result.returncode == 4 and result.stderr.rstrip().endswith(
        "commonest error (4 rows): truncated at --max-tokens (dropped)"), result.stderr
    assert jsonl(tmp_path / "dropped" / "data.jsonl") == []
    assert len(jsonl(tmp_path / "dropped" / "errors.jsonl")) == 4
    stats = json.loads((tmp_path / "dropped" / "stats.json").read_text())
    assert stats["rows"]["truncated"] == stats["rows"]["dropped_truncated"] == 4


def test_two_endpoints_share_the_work_and_a_dead_one_is_routed_around(vllm_server, tmp_path):
    rows, dead = prompt_rows(30), f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    with FaultProxy(vllm_server.port) as a, FaultProxy(vllm_server.port) as b:
        ok(generate("--endpoint", a.base_url, "--endpoint", f"{b.base_url}/v1", "--endpoint", dead,
                    "--model", "tiny", "--dataset", write_jsonl(tmp_path / "p.jsonl", rows),
                    "--out", out, "--concurrency", "3", "--max-tokens", "200"))
    assert_exactly_once(out, [r["id"] for r in rows])
    used = [t["endpoint"] for r in jsonl(out / "data.jsonl") for t in r["turns"]]
    for proxy in (a, b):
        assert used.count(proxy.base_url + "/v1") >= len(used) / 4
    stats = json.loads((out / "stats.json").read_text())["endpoints"][dead + "/v1"]
    assert stats["failed"] == stats["requests"] > 0


def test_every_endpoint_dead_stops_cleanly_keeping_completed_rows(vllm_server, tmp_path):
    out, prompts = tmp_path / "out", write_jsonl(tmp_path / "p.jsonl", prompt_rows(10))
    ok(generate("--endpoint", vllm_server.base_url, "--dataset", prompts, "--out", out, "--n", 4,
                *LEAN))
    result = generate("--endpoint", f"http://127.0.0.1:{free_port()}", "--model", "tiny",
                      "--dataset", prompts, "--out", out, "--give-up-after", 3, *LEAN)
    assert result.returncode == 3, result.stderr
    assert "every endpoint has failed for 3 s" in result.stderr and "Traceback" not in result.stderr
    assert complete_lines(out / "data.jsonl") == 4
    assert json.loads((out / "stats.json").read_text())["outcome"] == "gave up"


def test_client_errors_are_recorded_at_once_and_retried_by_the_next_run(vllm_server, tmp_path):
    out, rows = tmp_path / "out", prompt_rows(3)
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    failed = generate("--endpoint", vllm_server.base_url, "--model", "no-such-model", "--dataset", prompts,
                      "--out", out, *LEAN)
    assert failed.returncode == 4 and "commonest error (3 rows): HTTP 404" in failed.stderr  # nothing made
    errors = jsonl(out / "errors.jsonl")
    assert len(errors) == 3 and all(e["status"] == 404 and e["attempts"] == 1 for e in errors)
    ok(generate("--endpoint", vllm_server.base_url, "--dataset", prompts, "--out", out, *LEAN))
    assert_exactly_once(out, [r["id"] for r in rows])
    assert jsonl(out / "errors.jsonl") == []


def test_api_key_comes_from_the_named_variable_only(vllm_server, tmp_path):
    secret = "sk-test-7f3a9c"
    out = tmp_path / "out"
    with FaultProxy(vllm_server.port) as proxy:
        result = ok(generate("--endpoint", proxy.base_url, "--api-key-env", "MY_KEY", "--dataset",
                             write_jsonl(tmp_path / "p.jsonl", prompt_rows(2)), "--out", out, *LEAN,
                             env={"MY_KEY": secret}))
    assert {r["headers"]["authorization"] for r in proxy.requests} == {f"Bearer {secret}"}
    for text in (result.stdout, result.stderr, *(p.read_text() for p in out.iterdir())):
        assert secret not in text
