"""The efficiency callback (`eff/*` in metrics.json) and its columns in `megalab-tables`."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import ROOT
from megalab import reporting as tb
from megalab.cli.train import train
from megalab.efficiency import EfficiencyMonitor, count_tokens
from megalab.reporting.efficiency import render_efficiency


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch["inputs"].float()).mean()

    def validation_step(self, batch, batch_idx):
        self.layer(batch["inputs"].float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batches(n: int) -> list[dict]:
    # 2 x 3 positions each, 5 of them real
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return [{"inputs": torch.ones(2, 3, 4), "mask": mask} for _ in range(n)]


def test_steps_tokens_memory_and_eval_throughput(tmp_path: Path) -> None:
    monitor = EfficiencyMonitor(warmup_steps=1)
    trainer = L.Trainer(
        max_steps=3, accumulate_grad_batches=2, callbacks=[monitor], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
        limit_val_batches=2, num_sanity_val_steps=1, default_root_dir=tmp_path,
    )  # fmt: skip
    batches = _batches(6)
    collate = lambda x: x[0]  # noqa: E731
    trainer.fit(
        _Tiny(),
        DataLoader(batches, batch_size=1, collate_fn=collate),
        DataLoader(_batches(2), batch_size=1, collate_fn=collate),
    )
    # three optimizer steps of two micro-batches each, 5 real tokens per micro-batch
    assert len(monitor.steps) == 3
    assert all(s["tokens"] == 10 for s in monitor.steps)
    summary = monitor.summary()
    measured = monitor.steps[1:]  # the first step is warm-up
    assert summary["eff/train_step_s"] == pytest.approx(sum(s["time"] for s in measured) / 2)
    assert summary["eff/train_tokens_per_s"] == pytest.approx(20 / sum(s["time"] for s in measured))
    assert summary["eff/peak_mem_mb"] > 10  # the process's resident set, in MB
    assert summary["eff/peak_mem_max_mb"] >= summary["eff/peak_mem_mb"]
    assert monitor.eval_tokens == 2 * 5  # the validation pass, not the sanity check
    assert summary["eff/eval_tokens_per_s"] > 0
    assert "eff/mfu" not in summary  # no known peak FLOP/s on CPU


def test_count_tokens() -> None:
    mask = torch.tensor([[True, False]])
    assert count_tokens({"inputs": torch.zeros(1, 2), "mask": mask}) == 1
    assert count_tokens({"inputs": torch.zeros(3, 4)}) == 12
    pair = {"inputs": torch.zeros(1, 2), "mask": mask, "inputs2": torch.zeros(1, 5)}
    assert count_tokens(pair) == 6
    assert count_tokens([torch.zeros(2)]) is None


def test_a_training_run_writes_the_efficiency_numbers(compose_cfg, tmp_path: Path) -> None:
    """With the default callbacks (as users get them), metrics.json holds the eff/* keys."""
    record = train(compose_cfg())
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for key in ("eff/train_step_s", "eff/train_tokens_per_s", "eff/peak_mem_mb",
                "eff/eval_tokens_per_s"):  # fmt: skip
        assert saved["metrics"][key] > 0, key
        assert record["metrics"][key] == saved["metrics"][key]


def _run(root: Path, name: str, experiment: str, speed: float, mem: float) -> None:
    run = root / name
    run.mkdir(parents=True)
    metrics = {"test/acc": 0.5, "eff/train_tokens_per_s": speed, "eff/peak_mem_mb": mem,
               "eff/train_step_s": 1.0 / speed, "eff/eval_tokens_per_s": 3 * speed}  # fmt: skip
    record = {"experiment": experiment, "seed": 1, "metrics": metrics}
    (run / "metrics.json").write_text(json.dumps(record))


def test_table2_speed_and_memory_columns_are_ratios_to_the_transformer(tmp_path: Path) -> None:
    _run(tmp_path, "xfm", "transformer/lra_text", speed=1000.0, mem=800.0)
    _run(tmp_path, "mega", "mega/lra_text", speed=2900.0, mem=248.0)
    _run(tmp_path, "chunk", "mega_chunk/lra_text", speed=5500.0, mem=104.0)
    table = next(t for t in tb.load_tables(ROOT / "tables") if t.id == "mega/table2_lra")
    text = render_efficiency(table, tb.collect_runs([tmp_path]))
    lines = text.splitlines()
    mega = lines[lines.index("| Mega | paper | 2.9× | 0.31× |") + 1]
    assert mega == "| | ours | 2.90× | 0.31× |"
    chunk = lines[lines.index("| Mega-chunk | paper | 5.5× | 0.13× |") + 1]
    assert chunk == "| | ours | 5.50× | 0.13× |"
    assert "| Mega | Text | mega/lra_text | 0.000345 | 2,900 | 248 | 8,700 | 1 |" in text
    # and the full report of megalab-tables carries it under the table
    report = tb.build_report(tb.collect_runs([tmp_path]), tb.load_tables(ROOT / "tables"))
    assert "#### Efficiency (Mega Table 2)" in report.markdown


def test_runs_behind_several_columns_of_a_row_are_listed_once(tmp_path: Path) -> None:
    """LaMemo Table 1 reads #Params, dev and test ppl from one run per model: one line each."""
    for name, experiment in (("xl", "transformer_xl/wikitext103"), ("lm", "lamemo/wikitext103")):
        run = tmp_path / name
        run.mkdir()
        metrics = {"val/ppl": 30.0, "test/ppl": 31.0, "eff/train_tokens_per_s": 100.0}
        record = {"experiment": experiment, "seed": 1, "metrics": metrics}
        (run / "metrics.json").write_text(json.dumps(record))
    table = next(t for t in tb.load_tables(ROOT / "tables") if t.id == "lamemo/table1_wt103")
    lines = render_efficiency(table, tb.collect_runs([tmp_path])).splitlines()
    rows = [line for line in lines if "| transformer_xl/wikitext103 |" in line]
    assert len(rows) == 1 and "| #Params (M), dev ppl, test ppl |" in rows[0]
    assert sum("| lamemo/wikitext103 |" in line for line in lines) == 1


def test_the_efficiency_lines_are_headed_by_what_the_paper_swept(tmp_path: Path) -> None:
    """A figure over chunk sizes heads its column with the chunk size; an ablation over attention
    functions heads its rows with the function; a task table keeps Model and Column."""
    _run(tmp_path, "text", "mega/lra_text", speed=1000.0, mem=800.0)
    # the run's config: Mega's full attention, as the figure's "full" point
    config = "model:\n  backbone:\n    chunk_size: -1\n    attention_activation: softmax\n"
    (tmp_path / "text" / "config.yaml").write_text(config)
    tables = {t.id: t for t in tb.load_tables(ROOT / "tables")}
    runs = tb.collect_runs([tmp_path])

    def header(table_id: str) -> str:
        lines = render_efficiency(tables[table_id], runs).splitlines()
        return next(line for line in lines if line.endswith("| Experiment | s / step | "
                    "train tokens/s | peak MB | eval tokens/s | n |"))  # fmt: skip

    assert header("mega/fig4_chunk_size").startswith("| Model | Chunk size c |")
    assert header("mega/table3_attention").startswith("| Attention function | Column |")
    assert header("mega/table2_lra").startswith("| Model | Column |")


def test_a_test_from_a_checkpoint_keeps_the_runs_own_numbers() -> None:
    """Lightning restores callback states when a test loads a checkpoint (the run's best, saved
    before its last steps, or another run's): only fitting takes them."""
    saved = {"steps": [{"time": 9.0, "tokens": 1.0, "peak_mb": 1.0}], "eval_time": 9.0,
             "eval_tokens": 9}  # fmt: skip
    monitor = EfficiencyMonitor()
    monitor.steps = [{"time": 1.0, "tokens": 10.0, "peak_mb": 1.0}] * 3
    monitor.setup(None, None, stage="test")  # type: ignore[arg-type]
    monitor.load_state_dict(saved)
    assert len(monitor.steps) == 3 and monitor.eval_time == 0.0
    monitor.setup(None, None, stage="fit")  # type: ignore[arg-type]
    monitor.load_state_dict(saved)  # a resumed run continues the saved record
    assert monitor.steps == saved["steps"] and monitor.eval_time == 9.0
