"""The design card's four commands, exactly as it writes them (`inv deploy`, `inv serve --wait`,
`inv generate --n 10000`, `inv train`), with a real vLLM serving the tiny model under tmux on a
network-namespace host, then `inv pull` (the stand-in's lifecycle tests: tests/host/test_serve.py)."""
import json
import re
import subprocess
import time

from tests.helpers.invoke_cli import REPO, inv
from tests.helpers.serve_bed import HOST_GET, PHASE, host_sh, inventory_port, outputs, tmux_inventory


def test_real_vllm_under_tmux(tmp_path, netns_trio, tiny_model, api_key):
    """The tiny model served by real vLLM through `inv serve --wait`, then a model path that does not exist.

    On a network-namespace host: its own /proc (vLLM reads /proc/<pid>, which the loopback bed's
    pid namespace lacks), network, /tmp and /root. The venv is this repo's, through a symlink;
    the model is copied in over SSH."""
    node = netns_trio[0]
    workdir = f"{node.workdir}/my work"
    host_sh(node, f"rm -rf '{workdir}' && mkdir -p '{workdir}/models/tiny' '{workdir}/cache' '{workdir}/inductor' "
                  f"'{workdir}/tmp' && ln -s {REPO}/.venv '{workdir}/venv'")
    tar = subprocess.run(["tar", "-C", str(tiny_model), "-c", "."], capture_output=True, check=True).stdout
    subprocess.run(node.ssh_argv(f"tar -C '{workdir}/models/tiny' -x"), input=tar, check=True, timeout=60)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CACHE_ROOT": f"{workdir}/cache", "TORCHINDUCTOR_CACHE_DIR": f"{workdir}/inductor",
           "TMPDIR": f"{workdir}/tmp"}
    common = dict(served_model_name="tiny", reasoning_parser="qwen3", max_model_len=512, env=env,
                  vllm_args=["--enforce-eager", "--dtype", "float32"])
    path = tmux_inventory(tmp_path, node, workdir, model="models/tiny", **common)
    port = inventory_port(path)
    try:
        # the card's words: the inventory's one group is where a bare task acts
        deployed = inv("deploy", inventory=path, timeout=300)
        assert deployed.returncode == 0 and node.name in deployed.stdout, outputs(deployed)
        started = time.monotonic()
        served = inv("serve", "--wait", inventory=path, timeout=400)
        assert served.returncode == 0, outputs(served)
        assert "tiny" in served.stdout and "512" in served.stdout and "ready_in" in served.stdout
        assert PHASE.search(served.stderr), served.stderr
        print(f"real vLLM ready after {time.monotonic() - started:.0f}s")
        # the key reached vLLM through the env file: without it, /v1/models is refused
        assert host_sh(node, f"/usr/bin/python3 - http://127.0.0.1:{port}/v1/models", HOST_GET).strip() == "401"

        status = inv("serve", "--status", "--json", inventory=path)
        row = json.loads(status.stdout)[0]  # model and max_model_len come from /v1/models, asked with the key
        assert row["state"] == "active (running)" and row["model"] == "tiny" and row["health"] == 200
        assert row["max_model_len"] == 512 and isinstance(row["running"], int)
        logs = inv("serve", "--on", node.name, "--logs", "--lines", "400", inventory=path)
        assert "Starting vLLM server" in logs.stdout

        # `inv generate --n 10000` end to end against this host's own vLLM (key from the env file), on a
        # 12-row dataset (the hub's default is out of reach here): the launch says it takes all 12
        host_sh(node, f"head -n 12 {REPO}/examples/prompts.jsonl > '{workdir}/twelve.jsonl'")
        gen = inv("generate", "--n", "10000", "--dataset", f"{workdir}/twelve.jsonl", inventory=path, timeout=300)
        assert gen.returncode == 0, outputs(gen)
        assert "12 rows" in gen.stdout and "--n 10000" in gen.stdout, outputs(gen)
        gen_id = re.search(r"\b(generate-\d{8}-\d{6})\b", gen.stdout).group(1)
        assert inv("logs", gen_id, "--follow", inventory=path, timeout=600).returncode == 0
        pulled = inv("pull", "--run", gen_id, "--dest", tmp_path / "artifacts", inventory=path)
        assert pulled.returncode == 0, outputs(pulled)
        data = tmp_path / "artifacts" / gen_id / node.name / "data.jsonl"
        records = [json.loads(line) for line in data.read_text().splitlines()]
        assert len({r["id"] for r in records}) == len(records) == 12
        answers = [m for r in records for m in r["messages"] if m["role"] == "assistant"]
        assert answers and all(m.get("reasoning") and m.get("content") for m in answers)

        # a bare `inv train` trains on the newest finished generate run, and says which
        trained = inv("train", inventory=path, timeout=120)
        assert trained.returncode == 0, outputs(trained)
        assert f"training on {gen_id}" in trained.stdout, outputs(trained)
        train_id = re.search(r"\b(train-\d{8}-\d{6})\b", trained.stdout).group(1)
        followed = inv("logs", train_id, "--follow", inventory=path, timeout=900)
        assert followed.returncode == 0, outputs(followed)
        assert host_sh(node, f"test -f '{workdir}/runs/{train_id}/draft/config.json' && echo yes").strip() == "yes"

        assert host_sh(node, f"stat -c '%a %U' '{workdir}/service/vllm.env'").strip() == "600 root"
        assert api_key not in host_sh(node, "ps -eo args")
        assert api_key not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert api_key not in outputs(served, status, logs)

        # a model path that is not there: refused before anything is written or started
        missing = tmux_inventory(tmp_path, node, workdir, model="models/no such model", **common)
        refused = inv("serve", "--on", node.name, "--wait", "--timeout", "300", inventory=missing)
        assert refused.returncode == 1, outputs(refused)
        assert f"the model {workdir}/models/no such model is not on the host" in refused.stdout
        assert "nothing was started" in refused.stdout
        assert host_sh(node, f"/usr/bin/python3 - http://127.0.0.1:{port}/health", HOST_GET).strip() == "200"
        # a directory that is no model: vLLM itself dies while starting, and that is noticed fast
        host_sh(node, f"mkdir -p '{workdir}/models/not a model'")
        broken = tmux_inventory(tmp_path, node, workdir, model="models/not a model", **common)
        started = time.monotonic()
        failed = inv("serve", "--on", node.name, "--wait", "--timeout", "300", inventory=broken, timeout=400)
        took = time.monotonic() - started
        assert failed.returncode == 1, outputs(failed)
        assert took < 120, f"took {took:.0f}s to notice"
        assert "died while starting" in failed.stdout and "last 50 log lines" in failed.stderr
        assert "not a model" in failed.stderr
        print(f"a broken model reported after {took:.0f}s")
    finally:
        inv("serve", "--on", node.name, "--stop", inventory=path)
