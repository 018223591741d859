"""`inv demo`'s sizes are checked before anything runs on the host."""
import io

import pytest

from specops import demo
from specops.errors import SpecopsError
from specops.inventory import Host


@pytest.mark.parametrize("sizes", [{"held_out": 0}, {"rows": 100, "held_out": 100}, {"train_steps": 0},
                                   {"train_seconds": -1}])
def test_demo_refuses_sizes_it_cannot_run_in_one_line_before_touching_the_host(sizes):
    host = Host("localhost", ("local",), {"ansible_connection": "local", "workdir": "/nonexistent/specops"})
    out = io.StringIO()
    with pytest.raises(SpecopsError) as refused:
        demo.pipeline(host, out=out, **sizes)
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value)
    assert out.getvalue() == ""  # no stage started
