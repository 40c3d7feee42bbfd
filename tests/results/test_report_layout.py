"""The report reads right in every case, fits a page in a real browser (1400 px
and 800 px), shows activation evidence as tables, and its plots show every configuration."""

import json
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest

from fixtures.make_run import make_run
from moebench.results import plots
from moebench.results.report import write_report
from moebench.results.report_words import plain_words as _plain_words
from moebench.results.summary import build_summary, config_entry

SIX = ("baseline", "kernel", "scheduler", "prefetch", "kernel+scheduler", "all")


@pytest.fixture(scope="module")
def six_config_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("six")
    run = make_run(root, configs=SIX, speed={"kernel": 150.0, "scheduler": 120.0, "prefetch": 98.0,
                                             "kernel+scheduler": 180.0, "all": 220.0},
                   items=80, flips={"all": list(range(30))})  # enough changed answers for p < 0.0001
    return write_report(run, root / "report")


def test_all_identical_sentences_make_sense(tmp_path):
    """No discordant pair: no 'interval from +0.00 to +0.00 ... cannot be ruled out'."""
    summary = build_summary(make_run(tmp_path, configs=("baseline", "kernel")))
    text = _plain_words(summary, config_entry(summary, "kernel"))
    assert "+0.00 to +0.00" not in text and "cannot be ruled out" not in text
    assert "identical: 0 of 40 items changed" in text and "at most 7.2% of items like these" in text
    assert "Every output matched the baseline's character for character" in text


def test_changed_and_undetected_accuracy_sentences(tmp_path):
    changed = build_summary(make_run(tmp_path / "a", configs=("baseline", "kernel"), flips={"kernel": list(range(20))}))
    text = _plain_words(changed, config_entry(changed, "kernel"))
    assert "Accuracy verdict over 120 answers" in text and "regression: accuracy fell" in text
    small = build_summary(make_run(tmp_path / "b", configs=("baseline", "kernel"), flips={"kernel": [1]}))
    text = _plain_words(small, config_entry(small, "kernel"))
    assert "inconclusive: difference" in text and "reaches below the -1-point margin" in text
    assert "Trial 0 alone, the seed report's statistic: 1 items right only for the baseline, 0 only for kernel" in text
    assert "decides nothing" in text


def test_markdown_shows_p_values_and_markup_literally(six_config_report):
    md = (six_config_report / "report.md").read_text()
    assert "&lt;" not in md and "&amp;" not in md
    assert "< 0.0001" in md


def test_markdown_escapes_tags_for_a_real_renderer(tmp_path):
    """The Markdown goes through a CommonMark renderer without turning model text into tags."""
    from markdown_it import MarkdownIt

    evil = '<script>alert("x")</script> AT&T &amp; <b>bold</b> p < 0.0001'
    run = make_run(tmp_path, configs=("baseline", "kernel"), diverge={"kernel": [2]}, outputs={("kernel", 2): evil})
    md = (write_report(run, tmp_path / "rep") / "report.md").read_text()
    rendered = MarkdownIt("commonmark").enable("table").render(md)
    assert "<script" not in rendered and "<b>" not in rendered


def test_evidence_is_a_table_per_config_not_raw_json(six_config_report):
    md = (six_config_report / "report.md").read_text()
    section = md[md.index("## Activation evidence"):md.index("## Plots")]
    assert '{"' not in section, "raw JSON in the evidence section"
    for name in SIX:
        assert f"### {name}: evidence (trial 0)" in section
    assert "| kernel | fused calls | 96 |" in section


def test_every_table_is_at_most_ten_columns(six_config_report):
    md = (six_config_report / "report.md").read_text()
    widths = [line.count("|") - 1 for line in md.splitlines() if line.startswith("|---")]
    assert widths and max(widths) <= 10, widths


# ---------------------------------------------------------------- a real browser

def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


MEASURE = """<script>(function(){var d=document.documentElement;
var t=[].slice.call(document.querySelectorAll('table')).map(function(x){return x.offsetWidth-x.parentElement.clientWidth});
document.body.setAttribute('data-overflow',JSON.stringify({width:window.innerWidth,page:d.scrollWidth-window.innerWidth,tables:t}));
})();</script>"""


@pytest.mark.parametrize("width", [1400, 800])
def test_html_fits_the_page_in_headless_chromium(six_config_report, tmp_path, width):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium): the layout check needs a real browser")
    html = (six_config_report / "report.html").read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", MEASURE + "</body>"))
    result = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             f"--window-size={width},900", "--dump-dom", probe.as_uri()],
                            capture_output=True, text=True, timeout=120)
    found = re.search(r'data-overflow="([^"]*)"', result.stdout)
    assert found, result.stderr[-2000:]
    measured = json.loads(found.group(1).replace("&quot;", '"'))
    assert measured["width"] == width
    assert measured["page"] <= 0, f"the page scrolls sideways by {measured['page']} px at {width} px"
    wide = [px for px in measured["tables"] if px > 0]
    assert not wide, f"{len(wide)} tables wider than the page at {width} px: {wide}"


# ---------------------------------------------------------------- plots

def _legend_of(draw, monkeypatch) -> list[str]:
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    assert draw() is not None
    (fig,) = figures
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_identical_configs_share_one_labelled_line(tmp_path, monkeypatch):
    summary = {"configs": [{"name": n} for n in ("baseline", "kernel", "prefetch", "scheduler")]}
    same = [5.0, 6.0, 7.0, 6.5]
    steps = pd.DataFrame([{"config": c, "trial": 0, "phase": "decode", "distinct_experts": v}
                          for c in ("baseline", "kernel", "prefetch") for v in same]
                         + [{"config": "scheduler", "trial": 0, "phase": "decode", "distinct_experts": v}
                            for v in (8.0, 9.0)])
    legend = _legend_of(lambda: plots.distinct_experts(summary, steps, tmp_path / "d.png"), monkeypatch)
    assert legend == ["baseline = kernel = prefetch (identical)", "scheduler"]

    samples = pd.DataFrame([{"config": c, "trial": 0, "item_id": i, "output_tokens": 10 + i % 5}
                            for c in ("baseline", "kernel", "prefetch") for i in range(20)]
                           + [{"config": "scheduler", "trial": 0, "item_id": i, "output_tokens": 30} for i in range(20)])
    legend = _legend_of(lambda: plots.output_lengths(summary, samples, tmp_path / "o.png"), monkeypatch)
    assert legend == ["baseline = kernel = prefetch (identical)", "scheduler"]


def test_merge_identical_keeps_different_curves_apart():
    groups = plots.merge_identical({"a": np.array([1.0, np.nan]), "b": np.array([1.0, np.nan]),
                                    "c": np.array([1.0, 2.0]), "d": np.array([1.0])})
    assert [names for names, _ in groups] == [["a", "b"], ["c"], ["d"]]
