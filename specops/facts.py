"""`inv hosts`: what each host is and whether specops can work there."""

from __future__ import annotations

from .host import Session, quote
from .supervisors import SYSTEMD_PROBE

_PROBE = r"""
py={python}; wd={workdir}
. /etc/os-release 2>/dev/null; echo "os=${{PRETTY_NAME:-$(uname -s)}}"
echo "python=$("$py" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo missing)"
d="$wd"; while [ ! -d "$d" ]; do d=$(dirname "$d"); done
echo "disk_kb=$(df -Pk "$d" | awk 'NR==2 {{print $4}}')"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader,nounits 2>/dev/null | sed 's/^/gpu=/'
fi
{systemd_probe}
for tool in tmux rsync; do command -v $tool >/dev/null 2>&1 && echo $tool=yes || echo $tool=no; done
"""


def probe(session: Session) -> dict:
    """One row of facts for `inv hosts` (all gathered in a single round trip)."""
    out = session.sh(_PROBE.format(python=quote(session.host.python), workdir=quote(session.workdir),
                                   systemd_probe=SYSTEMD_PROBE),
                     timeout=30).stdout
    facts: dict = {"gpu": []}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key == "gpu":
            facts["gpu"].append([part.strip() for part in value.split(",")])
        elif key:
            facts[key] = value
    return {
        "reachable": True,
        "os": facts.get("os", "?"),
        "python": facts.get("python", "?"),
        "disk_free": f"{int(facts.get('disk_kb') or 0) / 2**20:.1f} GiB",
        "gpus": describe_gpus(facts["gpu"]),
        "systemd": facts.get("systemd") == "yes",
        "tmux": facts.get("tmux") == "yes",
        "rsync": facts.get("rsync") == "yes",
    }


def describe_gpus(gpus: list[list[str]]) -> str:
    """'8x NVIDIA H200 (143771 MiB, driver 570.86)' or 'none'."""
    if not gpus:
        return "none"
    name, mem, driver = (gpus[0] + ["?", "?", "?"])[:3]
    return f"{len(gpus)}x {name} ({mem} MiB, driver {driver})"
