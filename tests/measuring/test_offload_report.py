"""The bundled default's ablation offloads to the device's own tier (disk on a CPU) and reports the
memory it saves: every config's expert memory and peak RSS, the all-resident reference beside the
offloaded baseline and lookahead, and the share of the offload penalty lookahead hides."""

import json

import typer
from typer.testing import CliRunner

from moebench.errors import MoebenchError
from moebench.results.report import write_report
from moebench.cli.run import run_command


def test_default_ablation_offloads_to_disk_and_reports_memory(tmp_path):
    app = typer.Typer()
    app.command("run")(run_command)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, ["run", "--ablate", "--limit", "3", "--repeats", "2", "--max-new-tokens", "8",
                                      "--warmup", "1", "--out", str(tmp_path), "--run-id", "r"])
    assert not isinstance(result.exception, MoebenchError) and result.exit_code == 0, result.output
    run_dir = tmp_path / "r"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["runtime"]["offload_tier"] == "disk"
    assert manifest["runtime"]["disk_read_mode"] in ("o_direct", "fadvise")
    assert {"name": "resident", "kernel": "naive", "scheduler": "static", "prefetch": "off",
            "expert_budget": "1.0"} in manifest["configs"]
    summary = json.loads((run_dir / "summary.json").read_text())
    memory = {c["name"]: c["memory"] for c in summary["configs"]}
    assert memory["resident"]["tier"] == "none (all resident)"
    for name in ("baseline", "prefetch", "all"):
        assert memory[name]["tier"] == "disk" and memory[name]["host_copy_bytes"] == 0
        assert memory[name]["process_rss_peak_bytes"] > 0
    off = summary["offload"]
    assert off["off"]["config"] == "baseline" and off["lookahead"]["config"] == "prefetch"
    # the budget (read buffers included) is all the disk tier holds: at most half of all-resident
    assert off["off"]["expert_memory_vs_resident"] <= 0.5 and off["lookahead"]["expert_memory_vs_resident"] <= 0.5
    assert len(off["penalty_hidden_trials"]) == 2
    out = write_report(run_dir, tmp_path / "report")
    md = (out / "report.md").read_text() if out.is_dir() else out.read_text()
    assert "## Expert memory and offloading" in md and "of the offload penalty" in md
