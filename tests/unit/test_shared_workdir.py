"""Two inventory entries for one machine must not share a workdir: they would share one service (each
`inv serve` restarting the other's), one runs/ and one set of tmux sessions. Refused at load, exit 2,
one line naming both entries."""

import pytest

from specops import inventory
from specops.errors import InventoryError


def _load(tmp_path, hosts: str, vars_: str = "{}"):
    path = tmp_path / "inv.yaml"
    path.write_text(f"all:\n  vars: {vars_}\n  children:\n    gpu:\n      hosts:\n{hosts}")
    return inventory.load(path)


SHARED = {
    "the README's two GPU halves, workdir forgotten": (
        "        h-a: {ansible_host: 10.0.0.5, gpus: '0,1,2,3', port: 8000}\n"
        "        h-b: {ansible_host: 10.0.0.5, gpus: '4,5,6,7', port: 8001}\n", "{workdir: /data/specops}"),
    "the default workdir, one user": (
        "        h-a: {ansible_host: 10.0.0.5, ansible_user: ml}\n"
        "        h-b: {ansible_host: 10.0.0.5, ansible_user: ml, port: 8001}\n", "{}"),
    "a trailing slash": (
        "        h-a: {ansible_host: 10.0.0.5, workdir: /data/x}\n"
        "        h-b: {ansible_host: 10.0.0.5, workdir: /data/x/}\n", "{}"),
    "an absolute workdir, two users": (
        "        h-a: {ansible_host: 10.0.0.5, ansible_user: a, workdir: /srv/w}\n"
        "        h-b: {ansible_host: 10.0.0.5, ansible_user: b, workdir: /srv/w}\n", "{}"),
    "two local entries": (
        "        h-a: {ansible_connection: local, workdir: w}\n"
        "        h-b: {ansible_connection: local, workdir: ./w/, port: 8001}\n", "{}"),
}


@pytest.mark.parametrize("case", sorted(SHARED))
def test_entries_sharing_a_machine_and_workdir_are_refused(tmp_path, case):
    hosts, vars_ = SHARED[case]
    with pytest.raises(InventoryError) as info:
        _load(tmp_path, hosts, vars_)
    message = str(info.value)
    assert "'h-a' and 'h-b' are one machine" in message and "own workdir" in message, message
    assert "\n" not in message and info.value.exit_code == 2


APART = {
    "own workdirs": "        h-a: {ansible_host: 10.0.0.5, workdir: /data/a}\n"
                    "        h-b: {ansible_host: 10.0.0.5, workdir: /data/b, port: 8001}\n",
    "other ssh ports (two containers)": "        h-a: {ansible_host: 10.0.0.5, ansible_port: 2201}\n"
                                        "        h-b: {ansible_host: 10.0.0.5, ansible_port: 2202}\n",
    "other machines": "        h-a: {ansible_host: 10.0.0.5}\n        h-b: {ansible_host: 10.0.0.6}\n",
    "~ of two users": "        h-a: {ansible_host: 10.0.0.5, ansible_user: a}\n"
                      "        h-b: {ansible_host: 10.0.0.5, ansible_user: b}\n",
    "one host in two groups": "        h-a: {ansible_host: 10.0.0.5}\n    other:\n      hosts:\n        h-a: {}\n",
}


@pytest.mark.parametrize("case", sorted(APART))
def test_entries_that_do_not_share_a_workdir_load(tmp_path, case):
    assert len(_load(tmp_path, APART[case]).hosts) in (1, 2)
