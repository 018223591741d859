"""Deploy cost vs raw rsync, same tree, same host, same run.

    .venv/bin/python bench/deploy.py

Builds a ~2,000-file / 50 MB tree, starts a loopback sshd test host, and times
(a) first deploy, (b) no-op deploy, (c) one changed file — each as a fresh process
(`python -c 'specops deploy'`: Python start-up and SSH connection set-up included) and
as a raw `rsync -a` of the same tree over ssh to the same host. Prints seconds, bytes
sent, and the differences. Target: no-op deploy ≤ raw no-op rsync + 1 s.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers.hostbed import loopback_sshd, write_inventory  # noqa: E402

DEPLOY = """
import sys, json
from specops import deploy, inventory
from specops.host import connect
(host,) = inventory.load(sys.argv[1]).select("bench")
with connect(host) as s:
    r = deploy.deploy(s, root=__import__("pathlib").Path(sys.argv[2]))
print(json.dumps({"files": r.files_changed, "bytes": r.bytes_sent}))
"""


def make_tree(root: Path) -> Path:
    rng = __import__("random").Random(0)
    for d in ("remote", "templates", "requirements", "examples"):
        (root / d).mkdir(parents=True)
    for i in range(2000):
        sub = root / "remote" / f"pkg{i % 40:02d}"
        sub.mkdir(exist_ok=True)
        size = 25_000 + rng.randrange(2_000)  # ~50 MB in all, incompressible
        (sub / f"file{i:04d}.py").write_bytes(os.urandom(size))
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def timed(argv, env=None):
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"failed: {argv[:3]}: {proc.stderr[-500:]}")
    return time.monotonic() - start, proc.stdout


def main():
    tmp = Path(tempfile.mkdtemp(prefix="bench-deploy-"))
    tree = make_tree(tmp / "tree")
    with loopback_sshd(tmp / "sshd", users=("root",)) as (host,):
        inv = write_inventory(tmp / "inventory.yaml", {"bench": [host]})
        env = {**os.environ, "SPECOPS_SSH_CONFIG": "none"}
        raw_dest = f"root@127.0.0.1:{host.workdir}/raw/"
        ssh = " ".join(host.ssh_argv("")[:-2])  # ssh options without user@host and command
        raw = ["rsync", "-a", "--stats", "-e", ssh, f"{tree}/", raw_dest]
        ours = [sys.executable, "-c", DEPLOY, str(inv), str(tree)]
        rows = []
        for label in ("first", "no-op", "one changed file"):
            if label == "one changed file":
                target = tree / "remote/pkg07/file0007.py"
                target.write_bytes(target.read_bytes()[:-100] + os.urandom(100))
            t_raw, out_raw = timed(raw)
            t_ours, out_ours = timed(ours, env)
            sent_raw = next(l for l in out_raw.splitlines() if l.startswith("Total bytes sent")).split(":")[1]
            rows.append((label, t_raw, t_ours, sent_raw.strip(), out_ours.strip()))
    print(f"{'case':<18}{'raw rsync s':>12}{'deploy s':>10}{'extra s':>9}  raw bytes sent / deploy result")
    for label, t_raw, t_ours, sent_raw, ours in rows:
        print(f"{label:<18}{t_raw:>12.2f}{t_ours:>10.2f}{t_ours - t_raw:>+9.2f}  {sent_raw} / {ours}")
    print("target: no-op deploy <= raw no-op rsync + 1 s; one changed file sends about that file's size (~25 KB)")


if __name__ == "__main__":
    main()
