"""specops tasks: flags in, one call to specops, a clear result out.  `inv --list`."""

from specops import facts, fanout
from specops.cli import HOST_HELP, select_hosts, task


@task(help={**HOST_HELP, "json": "print JSON instead of a table"})
def hosts(c, on=None, inventory=None, json=False):
    """Check each host: reachable, OS, Python, free disk, GPUs, systemd, tmux, rsync."""
    return fanout.report(fanout.each(select_hosts(c, inventory, on), facts.probe), as_json=json)
