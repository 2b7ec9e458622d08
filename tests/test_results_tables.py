"""scripts/results_tables.py: the generated tables of docs/benchmarks.md are what the committed JSON
in docs/results/ says (a stale table fails here), a changed figure changes its table, and a GPU
run's folder of results renders as tables."""

import importlib.util
import json
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
RESULTS = os.path.join(ROOT, "docs", "results")

_spec = importlib.util.spec_from_file_location(
    "results_tables", os.path.join(ROOT, "scripts", "results_tables.py"))
tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tables)


def doc_text():
    with open(DOC) as f:
        return f.read()


def test_the_committed_tables_are_generated_from_the_committed_json():
    text = doc_text()
    for name in tables.SECTIONS:  # every section is in the document
        assert f"<!-- results_tables: {name} -->" in text, name
    assert tables.render(text, RESULTS) == text, (
        "docs/benchmarks.md is stale: run python scripts/results_tables.py")
    assert tables.main(["--check"]) == 0


def test_a_changed_figure_changes_its_table(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    path = results / "cpu_long_context_32k.json"
    r = json.loads(path.read_text())
    r["run"]["losses"] = [9.87654, 9.5]
    path.write_text(json.dumps(r))
    new = tables.render(doc_text(), str(results))
    assert "| 9.8765, 9.5000 |" in new and "| 11.1025, 11.1026 |" not in new
    assert tables.main(["--check", "--results", str(results)]) == 1  # the document is now stale


def test_a_gpu_runs_folder_renders_as_tables(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    for committed in [d for d in results.iterdir() if d.is_dir()]:  # the committed GPU runs' folders
        shutil.rmtree(committed)
    run = results / "2026-12-01-h100"
    run.mkdir()
    shutil.copy(results / "cpu_long_context_32k.json", run / "long_32k_auto.json")
    shutil.copy(results / "plan_qwen2_5_7b_h100_host128gib.json", run / "plan_local.json")
    (run / "part2.json").write_text(json.dumps({"kind": "gpu_checklist", "steps": [
        {"name": "long_32k_auto", "rc": 0, "seconds": 80.5, "timeout_s": 150, "timed_out": False},
        {"name": "long_128k_auto", "rc": 124, "seconds": 170, "timeout_s": 170, "timed_out": True}]}))
    section = "\n".join(tables.gpu(str(results)))
    assert section.startswith("#### 2026-12-01-h100")
    assert "| long_32k_auto.json | 32,768 | blockwise | 185.91, 183.38 | 179 |" in section
    assert "| plan_local.json | 524,288 | 231.90 GB | 104.24 GB | backward | on | no |" in section
    assert "| part2.json | long_128k_auto | exit 124 (timed out) | 170 | 170 |" in section
    empty = tmp_path / "empty"
    empty.mkdir()
    assert tables.gpu(str(empty)) == [
        "No GPU results are committed yet (docs/results/<date>-<gpu>/ holds them)."]


def test_bad_markers_are_errors_with_the_line():
    with pytest.raises(ValueError, match="line 2: unknown section 'nope'"):
        tables.render("text\n<!-- results_tables: nope -->\n<!-- /results_tables -->", RESULTS)
    with pytest.raises(ValueError, match="line 1: section 'gpu' has no"):
        tables.render("<!-- results_tables: gpu -->\n| a |", RESULTS)
