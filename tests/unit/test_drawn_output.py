"""A foreground command's output drawn for people (the demo's model build): its machine progress lines
become a progress line, its other lines print as they are, on a pipe as on a terminal."""
import io

from specops.host import Session
from specops.inventory import Host
from specops.watch import DrawnOutput

SCRIPT = r"""
printf 'building\n'
printf 'specops-progress {"stage":"train","step":3,"steps":600,"loss":0.5}\n'
printf 'specops-progress {"stage":"train","step":600,"steps'   # torn: a person never sees it
printf '\nspecops-progress {"stage":"done","out":"/m"}\nlast words'
"""


def test_machine_lines_become_a_progress_line_and_nothing_raw_reaches_the_screen(tmp_path):
    host = Host("localhost", ("local",), {"ansible_connection": "local", "workdir": str(tmp_path)})
    screen = io.StringIO()
    drawn = DrawnOutput(host.name, screen)
    try:
        Session(host).open().sh(SCRIPT, hide=False, out_stream=drawn)
    finally:
        drawn.close()
    shown = screen.getvalue()
    assert "specops-progress" not in shown and "{" not in shown, shown
    assert "building" in shown and "last words" in shown
    assert "localhost: done" in shown, shown  # the last phase is printed at the end
