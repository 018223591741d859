"""report.html per run, opened in a real headless Chromium; TensorBoard's own reader on train's events;
`inv report RUN` on a real test host.

The runs are the real scripts' (generate against the real vLLM, train, eval starting its own vLLM,
extract with the offline vLLM): each draws its report itself at its end. Screenshots go to
$SPECOPS_SCREENSHOTS (default: the test's tmp dir); README's picture is the train one.
"""
import base64
import io
import os
import re
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from tests.helpers import browser
from tests.helpers.capability import require
from tests.helpers.fixtures_train import REMOTE, evaluate, metrics
from tests.helpers.invoke_cli import inv
from tests.helpers.extraction import extract, subset
from tests.helpers.runs_bed import prepare, start, wait_for

# Each kind's report and the plots it must show (one <img> per plot).
PLOTS = {"generate": 3, "train": 6, "eval": 2, "extract": 1}


@pytest.fixture(scope="module")
def eval_run(tiny_model, trained_run, heldout_prompts, tmp_path_factory):
    """An eval run directory: the trained draft against the tiny target, servers started by eval.py."""
    out = tmp_path_factory.mktemp("eval")
    evaluate(tiny_model, trained_run / "draft", heldout_prompts, out / "report.json", "--max-tokens", "64")
    return out


@pytest.fixture(scope="module")
def extract_run(tiny_model, generated_data, tmp_path_factory):
    """An extract run directory: 20 generated rows' states in small shards (several shard writes)."""
    work = tmp_path_factory.mktemp("extract")
    data = subset(generated_data, 20, work / "data.jsonl")
    extract(tiny_model, data, work / "out", "--shard-mb", "0.05", "--scratch-gb", "1", work=work)
    return work / "out"


@pytest.fixture(scope="module")
def chromium():
    require(browser.executable() is not None, "chromium is not installed (scripts/setup installs it)")
    with browser.Chromium() as b:
        yield b


@pytest.fixture
def run_dirs(request, generated_data, trained_run):
    lazy = {"generate": lambda: generated_data, "train": lambda: trained_run,
            "eval": lambda: request.getfixturevalue("eval_run"), "extract": lambda: request.getfixturevalue("extract_run")}
    return lazy


@pytest.mark.parametrize("kind", list(PLOTS))
def test_report_renders_its_plots_in_a_real_browser(kind, run_dirs, chromium, tmp_path):
    run_dir = Path(run_dirs[kind]())
    page = run_dir / "report.html"
    assert page.is_file(), f"{kind} drew no report.html in {run_dir}: {sorted(os.listdir(run_dir))}"
    text = page.read_text()
    assert not re.search(r"""(src|href)=["'](?!data:)""", text), "the page refers to something outside itself"

    heading = text[text.index("<h1"):text.index("</p>", text.index("<h1"))]
    assert "?" not in heading and f"{kind} run " in heading, heading  # no placeholder where a value belongs
    shown = chromium.render(page)
    assert shown.failed == [] and shown.console == [], (shown.failed, shown.console)
    assert len(shown.images) == PLOTS[kind], shown.images
    for img in shown.images:  # decoded and laid out: a broken data: URI has no natural size
        assert img["complete"] and img["width"] >= 400 and img["height"] >= 200, img
    for src in re.findall(r'src="data:image/png;base64,([^"]+)"', text):  # each plot has ink on it
        plot = Image.open(io.BytesIO(base64.b64decode(src))).convert("L")
        assert ImageStat.Stat(plot).stddev[0] > 10, "a blank plot"
    shot = Image.open(io.BytesIO(shown.screenshot))
    assert shot.width >= 1000 and shot.height >= 300 and ImageStat.Stat(shot.convert("L")).stddev[0] > 10
    folder = Path(os.environ.get("SPECOPS_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"report-{kind}.png").write_bytes(shown.screenshot)


def test_a_page_that_reaches_out_is_caught(chromium, tmp_path):
    """The browser check itself: a page with a remote image and a broken one fails it (so its passes count)."""
    page = tmp_path / "report.html"
    page.write_text('<!doctype html><img src="http://127.0.0.1:9/x.png"><img src="data:image/png;base64,AAAA">')
    shown = chromium.render(page)
    assert shown.failed and [img["width"] for img in shown.images] == [0, 0]


def test_tensorboard_reads_the_train_runs_scalars(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained_run))
    events.Reload()
    assert {"train/loss", "train/acc_0", "train/sim_al", "train/lr", "train/vocab_coverage"} <= set(events.Tags()["scalars"])
    written = metrics(trained_run)
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [m["step"] for m in written]
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in written], rel=1e-6)
    coverage = [e.value for e in events.Scalars("train/vocab_coverage")]
    assert coverage == pytest.approx([m["vocab_coverage"] for m in written], rel=1e-6)
    assert set(coverage) == {1.0}  # trained_run's draft has the target's whole vocabulary: every loss token is in it


def test_no_tensorboard_writes_no_event_files(tiny_model, generated_data, tmp_path):
    from tests.helpers.fixtures_train import train

    out = train(tiny_model, generated_data, tmp_path / "run", "--steps", "3", "--no-tensorboard")
    assert not list(out.glob("events.out.tfevents.*")) and (out / "report.html").is_file()


REPORT_PAYLOAD = """
import shutil, sys
shutil.copy(sys.argv[1], "metrics.jsonl")
sys.path.insert(0, sys.argv[2])
import report
report.finish(".", "train")
"""


def test_inv_report_pulls_the_run_and_prints_the_path(tmp_path, ssh_host, trained_run):
    path, [host] = prepare(tmp_path, [ssh_host])
    run_id = start([host], REPORT_PAYLOAD, trained_run / "metrics.jsonl", REMOTE, name="drawn")
    wait_for(host, run_id, {"succeeded"}, timeout=120)
    dest = tmp_path / "home"
    proc = inv("report", run_id, "--on", "bed", "--dest", dest, inventory=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    local = dest / run_id / host.name / "report.html"
    assert proc.stdout == f"{local.resolve()}\n" and "<img" in local.read_text()
    again = inv("report", run_id, "--on", "bed", "--dest", dest, inventory=path)
    assert again.stdout == proc.stdout and again.stderr == ""  # here already: no second pull
    missing = inv("report", "nosuchrun", "--on", "bed", "--dest", dest, inventory=path)
    assert missing.returncode != 0 and "no run nosuchrun" in missing.stdout + missing.stderr
