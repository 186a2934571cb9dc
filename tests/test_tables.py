"""Paper tables (`tables/`), the table tool (`megalab-tables`) and the reproduce targets.

The published numbers load with their provenance and match the paper's own averages; runs are
matched to cells, averaged over seeds and rendered beside the paper's numbers with the
difference, the seed count and `missing` marks; sweep results become plots; and
`make reproduce-mega-lra SMOKE=1` runs end to end offline.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import CONFIG_DIR, ROOT
from megalab import reporting as tb
from megalab.cli.tables import main as tables_main

TABLES = tb.load_tables(ROOT / "tables")
BY_ID = {t.id: t for t in TABLES}


def write_run(
    root: Path,
    name: str,
    experiment: str,
    seed: int | None,
    acc: float | None,
    config: dict | None = None,
    **metrics: float,
) -> Path:
    """A run folder as megalab.cli.train writes it: metrics.json and the resolved config.yaml."""
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    values = {"val/acc_best": 0.5, **metrics}
    if acc is not None:
        values["test/acc"] = acc
    record = {"experiment": experiment, "seed": seed, "metrics": values, "params": {"total": 1000}}
    (run / "metrics.json").write_text(json.dumps(record))
    (run / "config.yaml").write_text(yaml.safe_dump(config or {"seed": seed}))
    return run


def write_sweep(root: Path, key: str, experiment: str, values: dict, smoke: bool = False) -> None:
    """A megalab-sweep folder: sweep.json plus runs {value: [acc per seed]}."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = {"parameters": [key, "seed"], "smoke": smoke, "points": []}
    i = 0
    for value, accs in values.items():
        for seed, acc in enumerate(accs, start=1):
            section, name = key.rsplit(".", 1)
            config: dict = {"seed": seed}
            node = config
            for part in section.split("."):
                node = node.setdefault(part, {})
            node[name] = value
            write_run(root, str(i), experiment, seed, acc, config)
            params = {key: value, "seed": seed}
            manifest["points"].append({"experiment": experiment, "params": params, "skipped": None})
            i += 1
    (root / "sweep.json").write_text(json.dumps(manifest))


# -- the paper files -------------------------------------------------------------------------
def test_a_checkout_with_its_root_elsewhere_finds_its_tables_and_sweeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MEGALAB_ROOT` moves data and logs (to a scratch disk); the paper tables and sweep files
    are still the checkout's, not a missing `<root>/tables` (an editable install has no
    packaged copy). A root with its own folders keeps them."""
    from megalab.utils.paths import resource_dir, source_checkout

    monkeypatch.setenv("MEGALAB_ROOT", str(tmp_path))
    assert source_checkout() == ROOT
    assert resource_dir("tables") == ROOT / "tables"
    assert resource_dir("sweeps") == ROOT / "sweeps"
    (tmp_path / "tables").mkdir()
    assert resource_dir("tables") == tmp_path / "tables"


def test_the_tables_are_those_of_the_project_the_process_is_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tables folder was fixed when `megalab.reporting` was first imported: a process that
    then moved `MEGALAB_ROOT` to another project (a notebook, the documentation tests one after
    another) kept reading the first project's tables."""
    import shutil

    import megalab.reporting as reporting

    shutil.copytree(ROOT / "tables", tmp_path / "tables")
    monkeypatch.setenv("MEGALAB_ROOT", str(tmp_path))
    assert reporting.tables_dir() == reporting.TABLES_DIR == tmp_path / "tables"
    (tmp_path / "tables" / "mega" / "table3_attention.yaml").unlink()
    ids = {table.id for table in reporting.load_tables()}
    assert "mega/table2_lra" in ids and "mega/table3_attention" not in ids


def test_mega_tables_are_there() -> None:
    assert {
        "mega/table2_lra",
        "mega/table3_attention",
        "mega/table4_sc",
        "mega/table5_lm",
        "mega/fig4_chunk_size",
        "mega/fig4_ema_dim",
        "mega/table1_summary",
        "mega/table6_wmt",
        "mega/table7_imagenet",
    } <= set(BY_ID)


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.id)
def test_every_cell_has_provenance(table: tb.PaperTable) -> None:
    assert table.paper and table.table and table.citation and table.rows and table.columns
    for cell in table.cells.values():
        assert cell.paper == table.paper and cell.table == table.table
        assert cell.row and cell.column and cell.source.endswith(Path(table.source).name)
        if cell.experiment:
            assert cell.metric, f"{table.id} {cell.row}/{cell.column} has no metric"


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.id)
def test_cells_name_existing_experiments(table: tb.PaperTable) -> None:
    for cell in table.reproducible:
        path = CONFIG_DIR / "experiment" / f"{cell.experiment}.yaml"
        assert path.is_file(), f"{table.id} {cell.row}/{cell.column}: no {path}"


def test_published_numbers() -> None:
    t2 = BY_ID["mega/table2_lra"]
    assert t2.cell("mega", "listops").value == 63.14
    assert t2.cell("mega", "listops").experiment == "mega/lra_listops"
    assert t2.cell("mega_chunk", "pathx").experiment == "mega_chunk/lra_pathx"
    assert t2.cell("xfm", "pathx").display == "✗" and t2.cell("xfm", "pathx").value is None
    assert t2.seeds == 5 and t2.cell("mega", "text").seeds == 5
    assert BY_ID["mega/table3_attention"].cell("relu2", "image").value == 90.22
    assert BY_ID["mega/table4_sc"].cell("mega_big", "acc").value == 97.30
    lm = BY_ID["mega/table5_lm"]
    assert (
        lm.cell("mega", "wt103_ppl").value == 18.07 and lm.cell("mega", "wt103_ppl").goal == "min"
    )
    c16 = BY_ID["mega/fig4_chunk_size"].cell("image", "c16")
    assert c16.approx and c16.value == 75 and c16.display == "≈75"
    assert c16.params == {"model.backbone.chunk_size": 16}


def test_table2_averages_match_the_paper() -> None:
    """Transcription check: each row's Avg. is the mean of its tasks (five when Path-X is ✗)."""
    t2 = BY_ID["mega/table2_lra"]
    avg = next(c for c in t2.columns if c.id == "avg")
    for row in t2.rows:
        values = [t2.cell(row.id, c).value for c in avg.mean_of]
        values = [v for v in values if v is not None]
        assert abs(statistics.fmean(values) - t2.cell(row.id, "avg").value) < 0.011, row.label


def test_tables_1_6_7_transcription() -> None:
    """Table 1 repeats Tables 2 (averages), 4, 5, 6 and 7; Table 6's columns name their metric."""
    t1, t2 = BY_ID["mega/table1_summary"], BY_ID["mega/table2_lra"]
    assert t1.cell("mega", "lra").value == t2.cell("mega", "avg").value == 88.21
    assert t1.cell("xfm", "lra").value == t2.cell("xfm_replicated", "avg").value == 59.24
    assert t1.cell("mega", "sc").value == BY_ID["mega/table4_sc"].cell("mega_big", "acc").value
    assert t1.cell("mega", "wt103").value == BY_ID["mega/table5_lm"].cell("mega", "wt103_ppl").value
    t6 = BY_ID["mega/table6_wmt"]
    assert t1.cell("mega", "wmt16").value == t6.cell("mega_softmax", "ende_tok").value == 29.18
    assert t1.cell("xfm", "wmt16").value == t6.cell("xfm_base_replicated", "ende_tok").value
    assert t6.cell("mega_laplace", "deen_sacre").value == 32.22
    assert t6.cell("mega_laplace", "deen_sacre").experiment == "mega/wmt16_de_en_laplace"
    assert t6.cell("mega_softmax", "ende_sacre").metric == "test/sacrebleu"
    assert t6.cell("xfm_base", "ende_tok").experiment is None  # Vaswani et al.'s number
    t7 = BY_ID["mega/table7_imagenet"]
    assert t7.cell("mega", "acc").value == 82.3 and t7.cell("deit_b", "acc").value == 81.8
    assert t1.cell("xfm", "imagenet").value == t7.cell("deit_b", "acc").value == 81.8


def test_hidden_columns_feed_an_average_without_being_printed() -> None:
    """Table 1's LRA cell is the mean of the per-task means (Table 2's cells), shown alone."""
    t1 = BY_ID["mega/table1_summary"]
    tasks = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
    accs = (0.6, 0.9, 0.9, 0.9, 0.9)
    runs = [tb.Run(f"transformer/lra_{t}", 1, {"metrics": {"test/acc": a}})
            for t, a in zip(tasks, accs)]  # fmt: skip
    runs.append(tb.Run("mega/wmt16_en_de", 1, {"metrics": {"test/bleu": 28.5}}))
    text = tb.render_table(t1, tb.summarize(t1, runs))
    header = text[text.index("| Model |") :].splitlines()[0]
    assert "ListOps" not in header and "LRA (Acc ↑)" in header
    xfm = text[text.index("| XFM | paper |") :].splitlines()
    assert xfm[1].startswith("| | ours | 84.00 |")  # five tasks: Path-X is ✗ for XFM
    mega = text[text.index("| Mega | paper |") :].splitlines()
    assert mega[1].startswith("| | ours | missing (0/6) | 28.50 |")


def test_csv_tables_load(tmp_path: Path) -> None:
    path = tmp_path / "seqboat" / "table1.csv"
    path.parent.mkdir()
    path.write_text(
        "paper,table,row,column,value,experiment,params,metric,scale,seeds,notes\n"
        "SeqBoat,Table 1,SeqBoat,ListOps,61.70,seqboat/lra_listops,,test/acc,100,3,\n"
        "SeqBoat,Table 1,SeqBoat,Text,≈89,seqboat/lra_text,a.b=1;c=x,test/acc,100,3,approx\n",
        encoding="utf-8",
    )
    (table,) = tb.load_tables(tmp_path)
    assert table.id == "seqboat/table1"
    cell = table.cell("SeqBoat", "Text")
    assert cell.approx and cell.value == 89 and cell.params == {"a.b": 1, "c": "x"}
    assert cell.seeds == 3 and cell.scale == 100
    runs = [tb.Run("seqboat/lra_listops", 1, {"metrics": {"test/acc": 0.6}})]
    assert "| | ours | 60.00 | missing |" in tb.render_table(table, tb.summarize(table, runs))


# -- matching, statistics, rendering ---------------------------------------------------------
def test_render_mean_std_delta_and_missing(tmp_path: Path) -> None:
    for seed, acc in ((1, 0.62), (2, 0.63), (3, 0.64)):
        write_run(tmp_path, f"listops{seed}", "mega/lra_listops", seed, acc)
    write_run(tmp_path, "text1", "mega/lra_text", 1, 0.95)
    os.utime(tmp_path / "text1" / "metrics.json", (1, 1))
    write_run(tmp_path, "text1-again", "mega/lra_text", 1, 0.90)  # the newest run of seed 1
    write_run(tmp_path, "other", "mega/lra_listops_variant", 7, 0.5)
    runs = tb.collect_runs([tmp_path])
    report = tb.build_report(runs, TABLES, wanted=["mega/table2_lra"])
    text = report.markdown
    assert report.tables == ["mega/table2_lra"]
    mega = text[text.index("| Mega | paper |") :].splitlines()
    assert mega[0].startswith("| Mega | paper | 63.14 | 90.43 |")
    assert mega[1].startswith("| | ours | 63.00 ± 1.00 | 90.00 | missing | missing |")
    assert mega[1].endswith("| missing (2/6) |")
    assert mega[2].startswith("| | Δ (n) | -0.14 (3) | -0.43 (1) |")
    assert "| XFM‡ | paper |" in text and "| Mega-chunk | paper |" in text
    assert text.count("| | ours |") == 1  # rows without runs show the paper's line only
    assert "mean of 5 seeds" in text and "Smoke" not in text
    assert "| mega/lra_listops_variant | — | 50.00 | 1 | ? |" in text  # no paper cell for it


def test_a_later_evaluation_of_a_run_takes_precedence(tmp_path: Path) -> None:
    """`megalab.cli.eval` (e.g. with the paper's longer test chunks) overrides the training test."""
    run = write_run(tmp_path, "wt103", "mega/wikitext103", 1, None, **{"test/ppl": 19.5})
    evaluation = {"ckpt_path": "x.ckpt", "metrics": {"test/ppl": 18.25, "test/loss": 2.9}}
    (run / "eval_metrics.json").write_text(json.dumps(evaluation))
    write_run(tmp_path, "enwik8", "mega/enwik8", 1, None, **{"test/bpc": 1.1})
    (tmp_path / "enwik8" / "eval_metrics.json").write_text("{not json")  # ignored, with a warning
    runs = {r.experiment: r for r in tb.collect_runs([tmp_path])}
    assert runs["mega/wikitext103"].metric("test/ppl") == 18.25
    assert runs["mega/wikitext103"].metric("val/acc_best") == 0.5  # the run's other metrics stay
    assert runs["mega/wikitext103"].record["evaluation"] == evaluation
    assert runs["mega/enwik8"].metric("test/bpc") == 1.1
    table = BY_ID["mega/table5_lm"]
    text = tb.render_table(table, tb.summarize(table, list(runs.values())))
    mega = text[text.index("| Mega | paper |") :].splitlines()
    assert "| 18.25 |" in mega[1] and "| 1.10 |" in mega[1]


def _has_experiments(table: tb.PaperTable, row: tb.Row) -> bool:
    """Whether the table file gives `row` an experiment (`experiments:` or `experiment:`)."""
    return any(c.experiment for c in table.cells.values() if c.row_id == row.id)


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.id)
def test_rows_with_experiments_show_an_ours_line_when_nothing_ran(table: tb.PaperTable) -> None:
    """Every row shows its paper line; a row the table file gives experiments also shows an ours
    line (all `missing` before any run), and a row no experiment reproduces shows none."""
    text = tb.render_table(table, tb.summarize(table, []))
    body = [line for line in text.splitlines() if line.startswith("| ")][1:]  # after the header
    i = 0
    for row in table.rows:
        paper = f"| {row.label} | paper |"
        while i < len(body) and not body[i].startswith(paper):
            i += 1
        assert i < len(body), f"{table.id}: no paper line for {row.label!r}"
        ours = i + 1 < len(body) and body[i + 1].startswith("| | ours |")
        assert ours == _has_experiments(table, row), f"{table.id} {row.label!r}"
        if ours:
            cells = [c.strip() for c in body[i + 1].split("|")[3:-1]]
            assert all(c.startswith("missing") or c == "—" for c in cells), cells
        i += 1


@pytest.mark.parametrize("table", [t for t in TABLES if t.reproducible], ids=lambda t: t.id)
def test_the_papers_own_rows_have_experiments(table: tb.PaperTable) -> None:
    """In a table we reproduce, the rows of the paper's own model (labels starting with its
    name: Mega, Mega-chunk, Mega (base), Megalodon, SeqBoat*, LaMemo) all have experiments;
    baselines have them where a config reproduces them (the S4D rows of Mega Tables 2 and 4)."""
    own = [r for r in table.rows if r.label.casefold().startswith(table.paper.casefold())]
    assert all(_has_experiments(table, r) for r in own), [r.label for r in own]


def test_an_experiment_fills_rows_of_another_papers_table_by_declaring_them() -> None:
    """The S4D experiments name Mega's S4 rows (`reproduces:`); the table files do not name
    them, yet their cells carry the experiments and the rows the experiments' notes."""
    table2, table4 = BY_ID["mega/table2_lra"], BY_ID["mega/table4_sc"]
    raw = yaml.safe_load((ROOT / "tables" / "mega" / "table2_lra.yaml").read_text())
    assert not any("experiments" in r for r in raw["rows"] if r["id"].startswith("s4"))
    for row in ("s4_v2", "s4_v2_replicated"):
        for task in ("listops", "text", "retrieval", "image", "pathfinder", "pathx"):
            assert table2.cells[(row, task)].experiment == f"s4d/lra_{task}"
        assert table2.cells[(row, "avg")].experiment is None  # a mean of the row, not a run
    assert table2.cells[("s4_v1", "text")].experiment is None
    assert {table4.cells[("s4_replicated", c)].experiment for c in ("params", "acc")} == {
        "s4d/sc10"
    }
    notes = {r.id: r.notes for r in table2.rows}
    assert notes["s4_v2_replicated"].startswith("S4-v2 as replicated by the Mega authors. Ours")
    assert notes["s4_v2_replicated"].count("Ours") == 1  # six experiments, one note


def test_a_declared_reproduction_must_name_a_real_row_and_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megalab.reporting import paper

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "bad.yaml").write_text("reproduces:\n  - {table: mega/table4_sc}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: each `reproduces:` entry is"):
        paper.declared_reproductions(tmp_path)
    gone = paper.Reproduction("s4d/sc10", "mega/table4_sc", "s4_renamed")
    monkeypatch.setattr(paper, "declared_reproductions", lambda: (gone,))
    with pytest.raises(ValueError, match="experiment s4d/sc10: mega/table4_sc has no row"):
        paper.check_reproductions(TABLES)
    column = paper.Reproduction("s4d/sc10", "mega/table4_sc", "s4_replicated", "speed")
    monkeypatch.setattr(paper, "declared_reproductions", lambda: (column,))
    with pytest.raises(ValueError, match="has no column 'speed'"):
        paper.check_reproductions(TABLES)


def test_a_malformed_table_stops_the_command_with_its_message(tmp_path: Path, capsys) -> None:
    (tmp_path / "tables" / "x").mkdir(parents=True)
    (tmp_path / "tables" / "x" / "t.yaml").write_text("paper: X\ntable: T\ncolumns: []\n")
    with pytest.raises(SystemExit) as exit_info:
        tables_main(["--all", "--tables-dir", str(tmp_path / "tables")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "t.yaml: missing `rows`" in err and "Traceback" not in err


def test_all_rows_show_when_nothing_ran() -> None:
    text = tb.render_table(BY_ID["mega/table4_sc"], tb.summarize(BY_ID["mega/table4_sc"], []))
    assert "| Mega (base) | paper | 300 | 96.92 |\n| | ours | missing | missing |" in text


def test_skipped_cells_say_why(tmp_path: Path) -> None:
    table = BY_ID["mega/table2_lra"]
    planned = [
        tb.Planned("mega/lra_listops", {}),
        tb.Planned("mega/lra_pathx", {}, "too long for a CPU"),
    ]
    runs = [tb.Run("mega/lra_listops", 1, {"metrics": {"test/acc": 0.6}})]
    text = tb.render_table(table, tb.summarize(table, runs), tb.plan_status(table, planned))
    assert "| | ours | 60.00 | missing | missing | missing | missing | skipped[^1] |" in text
    assert "[^1]: Skipped (Mega / Path-X): too long for a CPU" in text


def test_sweep_runs_match_only_cells_with_their_parameter(tmp_path: Path) -> None:
    write_sweep(
        tmp_path / "s", "model.backbone.chunk_size", "mega/lra_text", {16: [0.9], -1: [0.8]}
    )
    runs = tb.collect_runs([tmp_path])
    assert {r.swept["model.backbone.chunk_size"] for r in runs} == {16, -1}
    fig4 = BY_ID["mega/fig4_chunk_size"]
    stats = tb.summarize(fig4, runs)
    assert stats[("text", "c16")].mean == pytest.approx(90.0)
    assert stats[("text", "full")].mean == pytest.approx(80.0) and stats[("image", "full")] is None
    # Table 2's Mega/Text cell is Mega's own setting, not a point of the chunk sweep.
    assert tb.summarize(BY_ID["mega/table2_lra"], runs)[("mega", "text")] is None
    # A plain Mega run reproduces Table 2 and Table 3's softmax cell (its configuration).
    plain = tb.Run(
        "mega/lra_text",
        1,
        {"metrics": {"test/acc": 0.9}},
        config={"model": {"backbone": {"attention_activation": "softmax"}}},
    )
    t3 = BY_ID["mega/table3_attention"]
    assert tb.matches(t3.cell("softmax", "text"), plain)
    assert not tb.matches(t3.cell("relu2", "text"), plain)


def test_sweep_plot_with_paper_points(tmp_path: Path) -> None:
    key = "model.backbone.chunk_size"
    values = {16: [0.75, 0.76, 0.74], 128: [0.85, 0.86], -1: [0.9, 0.91]}
    write_sweep(tmp_path / "image", key, "mega/lra_image", values, smoke=True)
    write_sweep(tmp_path / "text", key, "mega/lra_text", {16: [0.9], 64: [0.89]})
    runs = tb.collect_runs([tmp_path])
    ticks, series = tb.sweep_series(key, runs, BY_ID["mega/fig4_chunk_size"], "test/acc", 100)
    assert ticks == ["16", "32", "64", "128", "256", "512", "full"]
    assert [s.label for s in series] == ["Text", "Image"]
    image = series[1]
    assert image.ours[0].n == 3 and image.ours[0].mean == pytest.approx(75.0)
    assert image.ours[1] is None and image.paper[0].display == "≈75"
    out = tmp_path / "report"
    report = tb.build_report(runs, TABLES, out=out)
    assert [p.name for p in report.plots] == ["chunk_size.png"]
    assert (out / "chunk_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.tables == ["mega/fig4_chunk_size"] and "**Smoke runs**" in report.markdown


def test_wandb_runs_are_read_through_the_public_api() -> None:
    """A stand-in for `wandb.Api()`: the attributes the public API's runs have."""
    sweep = SimpleNamespace(config={"parameters": {"model.backbone.ema_dim": {"values": [0, 16]}}})
    run = SimpleNamespace(
        config={
            "model.backbone.ema_dim": 0,  # what the agent sets
            "experiment_name": "mega/lra_image",
            "seed": 3,
            "model": {"backbone": {"ema_dim": 0}},
            "params": {"total": 123},
        },
        summary={"test/acc": 0.45, "val/acc_best": 0.46, "_runtime": 10},
        sweep=sweep,
        path=["team", "megalab", "abc123"],
        created_at="2026-01-01T00:00:00Z",
    )

    class Api:
        def runs(self, path: str, filters: dict | None = None) -> list:
            assert path == "team/megalab" and filters == {"state": "finished"}
            return [run]

    (got,) = tb.collect_wandb_runs("team/megalab", api=Api())
    assert got.experiment == "mega/lra_image" and got.seed == 3 and got.metric("test/acc") == 0.45
    assert got.swept == {"model.backbone.ema_dim": 0} and got.metric("params.total") == 123
    assert got.source == "wandb:team/megalab/abc123"
    fig4 = BY_ID["mega/fig4_ema_dim"]
    assert tb.matches(fig4.cell("image", "h0"), got)
    assert not tb.matches(fig4.cell("image", "h16"), got)


def test_cli_writes_table_and_rejects_unknown_tables(tmp_path: Path, capsys) -> None:
    write_run(tmp_path, "a", "mega/lra_listops", 1, 0.6)
    assert tables_main([str(tmp_path)]) == 0
    assert "| | ours | 60.00 |" in capsys.readouterr().out
    assert "### Mega Table 2" in (tmp_path / "table.md").read_text()
    with pytest.raises(SystemExit):
        tables_main([str(tmp_path), "--table", "mega/no_such_table"])


def test_a_wandb_project_that_cannot_be_read_says_why_in_one_line(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not logged in (here: W&B's own error, raised by a stand-in for the API call)."""
    import wandb.errors

    import megalab.cli.tables as tables_cli

    def not_logged_in(path: str) -> list:
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(tables_cli, "collect_wandb_runs", not_logged_in)
    with pytest.raises(SystemExit) as exit_info:
        tables_main([str(tmp_path), "--wandb", "team/megalab"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "megalab-tables: error: --wandb team/megalab: No API key configured. "
        "Use `wandb login` to log in."
    )


# -- make targets ----------------------------------------------------------------------------
def _make(tmp_path: Path, target: str, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "MEGALAB_ROOT": str(ROOT),
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    cmd = ["make", "--no-print-directory", "-C", str(ROOT), target, "SMOKE=1", "SEEDS=1"]
    cmd += ["REPRO_INSTALL=", f"REPRO_ROOT={tmp_path}", f"BIN={Path(sys.executable).parent}"]
    return subprocess.run(
        [*cmd, *args], env=env, capture_output=True, text=True, timeout=3000, check=False
    )


def _table(tmp_path: Path, target: str) -> str:
    (folder,) = (tmp_path / target).iterdir()
    return (folder / "table.md").read_text()


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@needs_make
def test_make_reproduce_mega_lra_smoke_listops(tmp_path: Path) -> None:
    """The target's wiring on one task: sweep, runs, table (the full target is slow)."""
    proc = _make(tmp_path, "reproduce-mega-lra", "ONLY=experiment=mega/lra_listops")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| Mega | paper | 63.14 | 90.43 |" in proc.stdout  # printed at the end
    text = _table(tmp_path, "reproduce-mega-lra")
    ours = text[text.index("| Mega | paper |") :].splitlines()[1]
    assert ours.startswith("| | ours | ") and ours.split("|")[3].strip()[0].isdigit()
    assert "**Smoke runs**" in text
    # the efficiency callback's run averages, under the table
    eff = text[text.index("#### Efficiency (Mega Table 2)") :].splitlines()
    row = next(line for line in eff if line.startswith("| Mega | ListOps | mega/lra_listops |"))
    assert all(c.strip()[0].isdigit() for c in row.split("|")[4:-1]), row


@needs_make
@pytest.mark.slow
def test_make_reproduce_mega_lra_smoke_end_to_end(tmp_path: Path) -> None:
    proc = _make(tmp_path, "reproduce-mega-lra")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = _table(tmp_path, "reproduce-mega-lra")
    for row, paper in (("Mega", "63.14"), ("Mega-chunk", "58.76")):
        lines = text[text.index(f"| {row} | paper | {paper} |") :].splitlines()
        cells = [c.strip() for c in lines[1].split("|")[3:-1]]
        # Every task ran, except Path-X (16K pixels: skipped on CPU) and the average.
        assert all(c[0].isdigit() for c in cells[:5]), cells
        assert cells[5].startswith("skipped")


@needs_make
@pytest.mark.slow
def test_make_reproduce_mega_ablations_and_sc_smoke(tmp_path: Path) -> None:
    proc = _make(tmp_path, "reproduce-mega-ablations", "SEEDS=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (folder,) = (tmp_path / "reproduce-mega-ablations").iterdir()
    assert {"chunk_size.png", "ema_dim.png", "attention_activation.png"} <= {
        p.name for p in folder.iterdir()
    }
    proc = _make(tmp_path, "reproduce-mega-sc")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| Mega (big) | paper | 476 | 97.30 |" in _table(tmp_path, "reproduce-mega-sc")


@needs_make
@pytest.mark.slow
def test_make_reproduce_mega_mt_smoke(tmp_path: Path) -> None:
    """Table 6 on the WMT fixture: every row trains, tests and lands in the table."""
    proc = _make(tmp_path, "reproduce-mega-mt")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| Mega-softmax | paper | 29.18 | 28.47 | 32.90 | 32.35 |" in proc.stdout
    text = _table(tmp_path, "reproduce-mega-mt")
    for row in ("XFM-base‡", "Mega-softmax", "Mega-laplace"):
        ours = text[text.index(f"| {row} | paper |") :].splitlines()[1]
        cells = [c.strip() for c in ours.split("|")[3:-1]]
        assert len(cells) == 4 and all(c[0].isdigit() for c in cells), (row, cells)


@needs_make
@pytest.mark.slow
def test_make_reproduce_mega_lm_and_imagenet_smoke(tmp_path: Path) -> None:
    """Table 5 with its second evaluation pass (eval_metrics.json in every run), Table 7."""
    proc = _make(tmp_path, "reproduce-mega-lm")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (folder,) = (tmp_path / "reproduce-mega-lm").iterdir()
    # One longer-chunk evaluation per run, in its own folder, with the copy the table reads.
    evaluations = list(folder.rglob("paper_test_chunk/eval_metrics.json"))
    assert len(evaluations) == 2, evaluations
    assert all((p.parents[1] / "eval_metrics.json").is_file() for p in evaluations)
    mega = _table(tmp_path, "reproduce-mega-lm")
    ours = mega[mega.index("| Mega | paper |") :].splitlines()[1]
    assert "missing" not in ours
    proc = _make(tmp_path, "reproduce-mega-imagenet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| Mega | paper | 90 | 82.3 |" in _table(tmp_path, "reproduce-mega-imagenet")


# Same path as reproduce-mega-lra (default suite), for Megalodon's table: slow (18 s).
@pytest.mark.slow
@needs_make
def test_make_reproduce_megalodon_lra_smoke_listops(tmp_path: Path) -> None:
    """Megalodon's LRA target on one task: its sweeps and Mega's, then Table 6 beside ours."""
    proc = _make(tmp_path, "reproduce-megalodon-lra", "ONLY=experiment=megalodon/lra_listops")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| Megalodon | paper | 63.79 | 90.48 |" in proc.stdout  # printed at the end
    text = _table(tmp_path, "reproduce-megalodon-lra")
    ours = text[text.index("| Megalodon | paper |") :].splitlines()[1]
    assert ours.startswith("| | ours | ") and ours.split("|")[3].strip()[0].isdigit()
    assert "| Mega | paper | 63.14 |" in text and "**Smoke runs**" in text


@pytest.mark.slow
@needs_make
@pytest.mark.parametrize(
    ("target", "rows"),
    [
        ("reproduce-megalodon-pg19", ["| Megalodon | paper | 29.5 | 25.4 |"]),
        ("reproduce-megalodon-wt103", ["| Mega | paper | 252 | 18.07 |",
                                       "| Megalodon | paper | 252 | 17.23 |"]),
        ("reproduce-megalodon-imagenet", ["| Mega | paper | 90 | 82.3 |",
                                          "| Megalodon | paper | 90 | 83.1 |"]),
    ],
)  # fmt: skip
def test_make_reproduce_megalodon_lm_and_imagenet_smoke(
    tmp_path: Path, target: str, rows: list[str]
) -> None:
    """SMOKE=1 fits these on a CPU: short LM segments, the 1.3B PG-19 model at a tiny width,
    ImageNet's fixture classes (and, without timm, a plain transform); every row is filled."""
    proc = _make(tmp_path, target)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = _table(tmp_path, target)
    for row in rows:
        ours = text[text.index(row) :].splitlines()[1]
        cells = [c.strip() for c in ours.split("|")[3:-1]]
        assert ours.startswith("| | ours |") and all(c[0].isdigit() for c in cells), (row, ours)


@pytest.mark.slow
@needs_make
def test_make_reproduce_lamemo_extrapolation_smoke(tmp_path: Path) -> None:
    """Fig. 5: two models trained, then 20 test-only runs of their checkpoints: each point
    counts the checkpoint's steps (no "stopped before its schedule" mark), and the evaluation
    memory changes the numbers."""
    proc = _make(tmp_path, "reproduce-lamemo-extrapolation")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = _table(tmp_path, "reproduce-lamemo-extrapolation")
    assert "Stopped before" not in text
    for row in ("LaMemo", "Transformer-XL"):
        lines = text[text.index(f"| {row} | paper |") :].splitlines()
        ours = [c.strip() for c in lines[1].split("|")[3:-1]]
        steps = [c.strip() for c in lines[3].split("|")[3:-1]]
        assert len(ours) == 10 and all(c[0].isdigit() and "†" not in c for c in ours), ours
        assert len(set(ours)) > 1, ours  # the memory, 64 ... 640, changes the numbers
        assert set(steps) == {"2 (smoke)"}, steps


def test_megalodon_tables_match_the_paper() -> None:
    """Transcription check of Table 6's averages (five tasks when Path-X is ✗)."""
    t6 = BY_ID["megalodon/table6_lra"]
    avg = next(c for c in t6.columns if c.id == "avg")
    for row in t6.rows:
        values = [t6.cell(row.id, c).value for c in avg.mean_of]
        values = [v for v in values if v is not None]
        assert abs(statistics.fmean(values) - t6.cell(row.id, "avg").value) < 0.011, row.label
    assert t6.cell("megalodon_chunk", "pathx").experiment == "megalodon_chunk/lra_pathx"
    assert BY_ID["megalodon/table8_wt103"].cell("megalodon", "ppl").value == 17.23
    assert BY_ID["megalodon/table5_pg19"].cell("megalodon", "test").metric == "test/word_ppl"
    for name in ("table1_short_context", "table2_scrolls", "table3_mt_bench"):
        assert not BY_ID[f"megalodon/{name}"].reproducible  # recorded, not reproducible here


def test_another_tables_folder_checks_the_reproductions_of_its_tables(tmp_path: Path) -> None:
    (tmp_path / "mega").mkdir()
    text = (ROOT / "tables" / "mega" / "table4_sc.yaml").read_text(encoding="utf-8")
    (tmp_path / "mega" / "table4_sc.yaml").write_text(
        text.replace("id: s4_replicated", "id: s4_renamed"), encoding="utf-8"
    )
    with pytest.raises(ValueError, match="experiment s4d/sc10: mega/table4_sc has no row"):
        tb.load_tables(tmp_path)
