"""The command line each job starts on a host (specops/jobs.py), without a host.

A real Session that never connects: its host's workdir is absolute and its home is known, so every
path it builds is computed here exactly as on a host.
"""
from specops import jobs
from specops.host import Session
from specops.inventory import Host

W = "/data/specops"
PY = f"{W}/venv/bin/python"


def session(**settings) -> Session:
    host = Host("gpu-a", ("gpu",), {"workdir": W, "model": "/models/k2", "served_model_name": "k2", "port": 8001,
                                    **settings})
    s = Session(host)
    s._home = "/home/ml"
    return s


def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_generate_gets_its_shard_last_and_a_shipped_file_from_the_deployed_code():
    argv = jobs.generate_argv(session(), n=500, dataset="examples/prompts.jsonl", part="1/2",
                              extra=["--shard", "0/9", "--max-tokens", "4096"])
    assert argv[:2] == [PY, f"{W}/code/remote/generate.py"]
    assert after(argv, "--endpoint") == "http://127.0.0.1:8001" and after(argv, "--model") == "k2"
    assert after(argv, "--dataset") == f"{W}/code/examples/prompts.jsonl" and after(argv, "--n") == "500"
    assert argv[-2:] == ["--shard", "1/2"]  # after what came after `--`: the plan's part wins
    alone = jobs.generate_argv(session(bind="::1"), dataset="mlabonne/open-perfectblend")
    assert "--shard" not in alone and "--n" not in alone and after(alone, "--endpoint") == "http://[::1]:8001"
    assert after(alone, "--dataset") == "mlabonne/open-perfectblend"  # a hub name is passed as is
    assert after(jobs.generate_argv(session(), dataset="~/rows.jsonl"), "--dataset") == "/home/ml/rows.jsonl"


def test_generate_is_told_the_served_context_and_leaves_a_max_tokens_that_cannot_fit_to_vllm():
    """`inv generate --n 10000` on a 512-token host: 8192 max tokens would be a 400 for every row."""
    import sys
    from tests.helpers.generate_cli import ROOT
    sys.path.insert(0, str(ROOT / "remote"))
    from generate import parse_args, sampling_params

    argv = jobs.generate_argv(session(max_model_len=512), n=10000)
    assert after(argv, "--context-tokens") == "512"
    assert "--context-tokens" not in jobs.generate_argv(session(), n=10)  # unknown: vLLM's own limit holds
    common = ["--endpoint", "http://x", "--out", "/o"]
    assert "max_tokens" not in sampling_params(parse_args([*common, "--context-tokens", "512"]))
    assert sampling_params(parse_args([*common, "--context-tokens", "512", "--max-tokens", "384"]))["max_tokens"] == 384
    assert sampling_params(parse_args([*common]))["max_tokens"] == 8192


def test_extract_reads_a_run_by_id_and_a_path_as_given():
    argv = jobs.extract_argv(session(vllm_args=["--trust-remote-code"]), data=["gen-1", "/x/data.jsonl"],
                             layers="2,30,58", stream=True)
    data = [argv[i + 1] for i, a in enumerate(argv) if a == "--data"]
    assert data == [f"{W}/runs/gen-1/data.jsonl", "/x/data.jsonl"]
    assert after(argv, "--storage") == f"{W}/service/hidden_states" and after(argv, "--target") == "/models/k2"
    assert after(argv, "--layers") == "2,30,58" and "--stream" in argv and "--trust-remote-code" in argv


def test_train_is_plain_python_without_gpus_torchrun_with_them_and_the_node_wrapper_in_a_group():
    plain = jobs.train_argv(session(), 0, 1, data=["gen-1"], nproc=0, steps=300, extra=["--lr", "1e-3"])
    assert plain[:2] == [PY, f"{W}/code/remote/train.py"] and after(plain, "--data") == f"{W}/runs/gen-1/data.jsonl"
    assert after(plain, "--steps") == "300" and plain[-2:] == ["--lr", "1e-3"]
    gpus = jobs.train_argv(session(), 0, 1, data=["gen-1"], nproc=8, states="ext-1", master="10.0.0.1")
    assert gpus[:3] == [PY, "-m", "torch.distributed.run"] and "--nproc-per-node=8" in gpus
    assert f"--master-port={jobs.TORCHRUN_PORT}" in gpus and after(gpus, "--states") == f"{W}/runs/ext-1/."
    node = jobs.train_argv(session(), 1, 2, data=["gen-1", "/x.jsonl"], nproc=0, grouped=True, master="10.0.0.1",
                           port=29600, run_id="train-1")
    assert node[:2] == [PY, f"{W}/code/remote/torchrun_node.py"] and "--nproc-per-node=1" in node
    assert "--node-rank=1" in node and "--master-port=29600" in node and "--rdzv-id=train-1" in node
    data = [node[i + 1] for i, a in enumerate(node) if a == "--data"]
    assert data == [f"{W}/data/gen-1/merged.jsonl", "/x.jsonl"]  # a group's run is the merged copy shipped to it


def test_eval_starts_its_servers_like_the_hosts_own():
    argv = jobs.eval_argv(session(tp=8, max_model_len=65536, vllm_args=["--trust-remote-code"]), draft="train-1",
                          n=50, k=4)
    assert after(argv, "--draft") == f"{W}/runs/train-1/draft" and after(argv, "--k") == "4"
    assert after(argv, "--prompts") == f"{W}/code/examples/prompts.jsonl" and "--max-model-len=65536" in argv
    assert [a for a in argv if a.startswith("--vllm-arg=")] == [
        "--vllm-arg=--tensor-parallel-size", "--vllm-arg=8", "--vllm-arg=--trust-remote-code"]


def test_train_measures_checkpoints_in_vllm_only_where_one_fits_beside_it():
    def train(**settings):
        return jobs.train_argv(session(**settings), 0, 1, data=["gen-1"], nproc=0, steps=900, eval_every=300)

    cpu = train(flavor="cpu", max_model_len=512, vllm_args=["--enforce-eager"])
    assert after(cpu, "--eval-every") == "300" and "--eval-vllm" in cpu  # a CPU host always has room
    assert "--eval-arg=--max-model-len=512" in cpu and "--eval-arg=--vllm-arg=--enforce-eager" in cpu
    gpu = train(tp=8)
    assert after(gpu, "--eval-every") == "300" and "--eval-vllm" not in gpu  # held-out rows only
    room = train(tp=8, train_eval_gpu_share=0.2)
    assert "--eval-vllm" in room and "--eval-arg=--vllm-arg=--tensor-parallel-size" in room
    assert "--eval-arg=--vllm-arg=--gpu-memory-utilization=0.2" in room  # the share the inventory gives
    assert "--eval-every" not in jobs.train_argv(session(), 0, 1, data=["gen-1"], nproc=0)
