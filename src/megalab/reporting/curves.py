"""Training loss curves and tokens/s side by side, as `python -m megalab.cli.curves` writes them.

Megalodon's Fig. 1 (training loss against tokens, Megalodon-7B against Llama-2-7B) and Fig. 4
(training tokens/s at 4K and 32K context) in miniature, for any set of language-model runs
(`make reproduce-megalodon-vs-llama`). For every run under the folders (a `metrics.json` and
the `csv/metrics.csv` every training run writes with the default CSV logger) it reads

- the training loss of every logged step (`train/loss_step`) and the validation loss
  (`val/loss`), placed on an axis of tokens seen: step x tokens per optimizer step, the tokens
  the efficiency monitor counted (`train/step_tokens_per_s` x `train/step_s`: real tokens of
  all processes), or `data.batch_size` x `data.max_len` where a run did not log them;
- the run's training throughput, `eff/train_tokens_per_s` of `metrics.json` (the monitor's
  average over the measured steps: warm-up steps, validation and checkpointing left out);

and writes `curves.png` (left: loss against tokens, one line per experiment, the mean over its
seeds at the steps they share; right: tokens/s per model, grouped by context length
`data.max_len`, with the ratio to the `--baseline` model at the same context, as Fig. 4) and
`curves.md` (the same numbers as a table). Runs of a `--smoke` sweep are marked as such.

`megalab.cli.curves` is the command line: `python -m megalab.cli.curves <run folders>`.
"""

from __future__ import annotations

import csv
import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megalab.reporting.plots import pyplot, save_figure
from megalab.reporting.runs import Run, collect_runs, config_value

log = logging.getLogger(__name__)

LOSS = "train/loss_step"
VAL_LOSS = "val/loss"
SPEED = "eff/train_tokens_per_s"


@dataclass
class Curve:
    """One run's training history on an axis of tokens seen."""

    run: Run
    model: str  # backbone class name (Megalodon, Llama, ...)
    context: int | None  # data.max_len
    tokens_per_step: float | None
    loss: dict[int, float] = field(default_factory=dict)  # optimizer step -> training loss
    val_loss: dict[int, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.run.experiment or Path(self.run.source).name


def _float(text: str | None) -> float | None:
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_history(path: Path) -> tuple[dict[int, float], dict[int, float], list[float]]:
    """Training and validation loss per step, and the tokens of each measured step, from a
    Lightning CSV log (one row per logging call, columns for every metric)."""
    loss: dict[int, float] = {}
    val: dict[int, float] = {}
    step_tokens: list[float] = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = _float(row.get("step"))
            if step is None:
                continue
            # the logged step is the global step before the optimizer step it reports
            n = int(step) + 1
            value = _float(row.get(LOSS))
            if value is not None:
                loss[n] = value
            value = _float(row.get(VAL_LOSS))
            if value is not None:
                val[n] = value
            rate, seconds = (
                _float(row.get("train/step_tokens_per_s")),
                _float(row.get("train/step_s")),
            )
            if rate is not None and seconds is not None:
                step_tokens.append(rate * seconds)
    return loss, val, step_tokens


def _model_name(run: Run) -> str:
    target = config_value(run.config, "model.backbone._target_") or config_value(
        run.config, "task.backbone._target_"
    )
    if not target:
        return "?"
    # The backbone's config class since backbones take one (`S4DConfig`), its class before
    # (`S4DBackbone`): one label for both.
    return str(target).rsplit(".", 1)[-1].removesuffix("Config").removesuffix("Backbone")


def load_curves(paths: Sequence[str | Path]) -> list[Curve]:
    """A `Curve` for every run under `paths` that logged its training loss."""
    curves = []
    for run in collect_runs(paths):
        history = Path(run.source) / "csv" / "metrics.csv"
        if not history.is_file():
            log.warning("no csv/metrics.csv in %s (logger=csv): no curve", run.source)
            continue
        loss, val, step_tokens = read_history(history)
        if not loss:
            log.warning("no %s in %s: no curve", LOSS, history)
            continue
        context = config_value(run.config, "data.max_len")
        per_step: float | None = statistics.median(step_tokens) if step_tokens else None
        if per_step is None:
            batch = config_value(run.config, "data.batch_size")
            per_step = float(batch) * float(context) if batch and context else None
        curves.append(
            Curve(
                run=run,
                model=_model_name(run),
                context=int(context) if context else None,
                tokens_per_step=per_step,
                loss=loss,
                val_loss=val,
            )
        )
    return curves


@dataclass
class Line:
    """An experiment's mean curve over its seeds (at the steps every seed that logged the
    metric logged)."""

    label: str
    model: str
    context: int | None
    tokens: list[float]
    loss: list[float]
    val_tokens: list[float]
    val_loss: list[float]
    seeds: int
    speed: float | None  # mean training tokens/s over seeds
    params: int | None
    smoke: bool


def _mean_on_common_steps(histories: Sequence[dict[int, float]]) -> tuple[list[int], list[float]]:
    histories = [h for h in histories if h]  # a seed that logged none does not empty the mean
    common = sorted(set.intersection(*(set(h) for h in histories))) if histories else []
    return common, [statistics.fmean(h[s] for h in histories) for s in common]


def lines(curves: Sequence[Curve]) -> list[Line]:
    """One `Line` per experiment, ordered by context length, then by label."""
    groups: dict[str, list[Curve]] = {}
    for c in curves:
        groups.setdefault(c.label, []).append(c)
    out = []
    for label, group in groups.items():
        per_step = statistics.fmean(c.tokens_per_step or math.nan for c in group)
        steps, loss = _mean_on_common_steps([c.loss for c in group])
        vsteps, vloss = _mean_on_common_steps([c.val_loss for c in group])
        speeds = [s for c in group if (s := c.run.metric(SPEED)) is not None]
        params = group[0].run.metric("params.total")
        out.append(
            Line(
                label=label,
                model=group[0].model,
                context=group[0].context,
                tokens=[s * per_step for s in steps],
                loss=loss,
                val_tokens=[s * per_step for s in vsteps],
                val_loss=vloss,
                seeds=len(group),
                speed=statistics.fmean(speeds) if speeds else None,
                params=int(params) if params is not None else None,
                smoke=any(c.run.smoke for c in group),
            )
        )
    seen: dict[tuple[str, int | None], str] = {}
    for ln in out:
        other = seen.setdefault((ln.model, ln.context), ln.label)
        if other != ln.label:
            log.warning(
                "%s and %s are both %s at context %s: the tokens/s bars and ratios show one "
                "of them (give megalab.cli.curves the runs of one comparison)",
                other, ln.label, ln.model, ln.context,
            )  # fmt: skip
    return sorted(out, key=lambda ln: (ln.context or 0, ln.label))


def speed_ratios(series: Sequence[Line], baseline: str) -> dict[str, float]:
    """tokens/s of every line over the baseline model's at the same context (label -> ratio)."""
    base = {
        ln.context: ln.speed
        for ln in series
        if ln.model.lower() == baseline.lower() and ln.speed is not None
    }
    return {
        ln.label: ln.speed / b
        for ln in series
        if ln.speed is not None and (b := base.get(ln.context)) is not None and b > 0
    }


def _context_label(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _final(values: Sequence[float]) -> float | None:
    """Mean of the last tenth of a curve (at least one point): the smoothed final loss."""
    if not values:
        return None
    k = max(1, len(values) // 10)
    return statistics.fmean(values[-k:])


def render_markdown(series: Sequence[Line], baseline: str) -> str:
    ratios = speed_ratios(series, baseline)
    out = [
        "| experiment | model | params | context | seeds | tokens seen | final train loss "
        f"| last val loss | train tokens/s | × {baseline} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ln in series:
        final = _final(ln.loss)
        cells = [
            ln.label,
            ln.model,
            f"{ln.params / 1e6:.1f}M" if ln.params else "—",
            _context_label(ln.context),
            str(ln.seeds),
            f"{ln.tokens[-1]:,.0f}" if ln.tokens else "—",
            f"{final:.4f}" if final is not None else "—",
            f"{ln.val_loss[-1]:.4f}" if ln.val_loss else "—",
            f"{ln.speed:,.1f}" if ln.speed is not None else "—",
            f"{ratios[ln.label]:.2f}" if ln.label in ratios else "—",
        ]
        out.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        "Final train loss: mean of the last tenth of the logged steps (mean over seeds); "
        "tokens/s: `eff/train_tokens_per_s` (the efficiency monitor's average over the "
        f"measured steps); × {baseline}: ratio to the {baseline} run at the same context "
        "(Megalodon Fig. 4: ≈0.94 at 4K, ≈1.32 at 32K for Megalodon-7B against Llama-2-7B).",
    ]
    if any(ln.smoke for ln in series):
        notes.append("\n**Smoke runs: 2 training steps on fixture data, not results.**")
    return "\n".join(out + notes) + "\n"


def plot_curves(path: str | Path, series: Sequence[Line], baseline: str, title: str) -> Path:
    """Write the PNG: loss against tokens (left), tokens/s by context and model (right)."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12.0, 4.8), dpi=150)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    models = sorted({ln.model for ln in series}, key=lambda m: (m.lower() == baseline.lower(), m))
    contexts = sorted({ln.context or 0 for ln in series})
    color = {m: colors[i % len(colors)] for i, m in enumerate(models)}
    styles = ["-", "--", ":", "-."]
    style = {c: styles[i % len(styles)] for i, c in enumerate(contexts)}
    for ln in series:
        kw = {"color": color[ln.model], "linestyle": style[ln.context or 0]}
        name = f"{ln.model} {_context_label(ln.context)}"
        ax.plot(ln.tokens, ln.loss, marker="." if len(ln.tokens) < 20 else None,
                label=f"{name} ({ln.label})", **kw)  # fmt: skip
        if ln.val_loss:
            ax.plot(ln.val_tokens, ln.val_loss, linestyle="none", marker="o",
                    markerfacecolor="white", markeredgecolor=color[ln.model])  # fmt: skip
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("Training loss (lines) and validation loss (circles)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)

    ratios = speed_ratios(series, baseline)
    width = 0.8 / max(1, len(models))
    for i, model in enumerate(models):
        xs, ys, texts = [], [], []
        for j, ctx in enumerate(contexts):
            bar = next((s for s in series if s.model == model and (s.context or 0) == ctx), None)
            if bar is None or bar.speed is None:
                continue
            xs.append(j + (i - (len(models) - 1) / 2) * width)
            ys.append(bar.speed)
            texts.append(f"{ratios[bar.label]:.2f}×" if bar.label in ratios else "")
        bars = bx.bar(xs, ys, width=width, color=color[model], label=model)
        bx.bar_label(bars, labels=texts, fontsize=8)
    bx.set_xticks(range(len(contexts)), [f"context {_context_label(c)}" for c in contexts])
    bx.set_ylabel("training tokens / s")
    bx.set_title(f"Training throughput (ratio to {baseline} at the same context)", fontsize=10)
    bx.grid(True, axis="y", alpha=0.3)
    bx.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path, any(ln.smoke for ln in series))
