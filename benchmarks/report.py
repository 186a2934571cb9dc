"""Markdown tables from the JSON of `bench_mega.py`, written into docs/benchmarks.md.

    python benchmarks/report.py results.json docs/benchmarks.md

Replaces what lies between `<!-- bench:begin -->` and `<!-- bench:end -->` in the document (the
rest is prose); without a document it prints the tables.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
TITLES = {
    "layer": "Layer forward + backward (speed ratio against `transformer` at the same L)",
    "ema": "EMA convolution and EMA sub-layer forward + backward (speed ratio against "
    "`conv_autograd`; the share is of the `mega_chunk128` layer step in the same rounds)",
    "attention": "Full attention alone, forward + backward (speed ratio against `sdpa_math`)",
    "kernel": "EMA kernel construction forward + backward (speed ratio against `kernel_naive`)",
    "precision": "bf16 autocast against float32, layer forward + backward (speed ratio against "
    "`mega_chunk128` in float32)",
    "compile": "torch.compile of the Mega-chunk layer (speed ratio against eager)",
}


def _ms(r: dict) -> str:
    return f"{1e3 * r['median']:,.1f} ({1e3 * r['min']:,.1f}-{1e3 * r['max']:,.1f})"


def _ratio(r: dict) -> str:
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def _section(name: str, rows: list[dict]) -> list[str]:
    share = name == "ema"
    head = (
        "| variant | L | B | CPU ms / iter (min-max) | × speed, CPU (min-max) | wall ms / iter "
        "(min-max) | × speed, wall (min-max) | saved B/token |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|"
    if share:
        head += " share of layer step, CPU |"
        rule += "---:|"
    lines = [f"#### {TITLES[name]}", "", head, rule]
    for r in rows:
        if r["kind"] == "mega_chunk128" and share:
            continue
        saved = r["saved_bytes_per_token"]
        line = (
            f"| {r['kind']} | {r['L']} | {r['B']} | {_ms(r['cpu'])} | "
            f"{_ratio(r['cpu_speed_ratio'])} | {_ms(r)} | {_ratio(r['speed_ratio'])} | "
            f"{'—' if saved != saved else f'{saved:,.0f}'} |"
        )
        if share:
            s = r.get("share_of_layer")
            line += f" {_ratio(s) if s else '—'} |"
        lines.append(line)
    return [*lines, ""]


def _scaling(rows: list[dict]) -> list[str]:
    lines = [
        "#### Mega-chunk layer on one long sequence: time per token against length",
        "",
        "| malloc | L | CPU ms / iter (min-max) | CPU ms per 1K tokens | × of the first L, "
        "CPU | wall ms / iter (min-max) | × of the first L, wall |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['malloc']} | failed: {r['error'][-120:]} | | | | | |")
            continue
        lines.append(
            f"| {r['malloc']} | {r['L']} | {_ms(r['cpu'])} | {r['cpu_ms_per_ktoken']:,.2f} | "
            f"{r['cpu_relative_to_first']:.2f} | {_ms(r)} | {r['relative_to_first']:.2f} |"
        )
    return [*lines, ""]


def render(record: dict) -> str:
    """The tables of one record, with a line saying how and where it was measured."""
    s = record["settings"]
    p = record["protocol"]
    load = ", ".join(f"{x:.1f}" for x in s.get("loadavg", []))
    lines = [
        f"Measured with `make bench`{' FULL=1' if p.get('full') else ''} "
        f"(`benchmarks/bench_mega.py`): torch {s['torch']}, {s['cpu']}, {s['cpus']} CPUs "
        f"shared with other jobs (load average {load or 'not recorded'} at the last start), "
        f"{s['threads']} intra-op thread(s), OMP_WAIT_POLICY={s['OMP_WAIT_POLICY']}, malloc: "
        f"{s['runtime'].get('malloc')}; {p['rounds']} rotated rounds after {p['warmup']} "
        f"warm-up pass(es), medians with min-max over rounds; {p['tokens']:,} tokens per batch "
        "(B = tokens // L), float32 unless the variant says bf16.",
        "",
    ]
    by_section: dict[str, list[dict]] = {}
    for r in record["rows"]:
        by_section.setdefault(r["section"], []).append(r)
    for name, rows in by_section.items():
        block = _scaling(rows) if name == "scaling" else _section(name, rows)
        note = record.get("sections", {}).get(name)
        if note:  # after the title line and its blank line
            block[2:2] = [f"Measured {note['start']}; load average {note['loadavg'][0]:.1f} at "
                          "the start of the section.", ""]  # fmt: skip
        lines += block
    return "\n".join(lines)


def write(record: dict, doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{render(record)}\n{END}{tail}", encoding="utf-8")


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    record = json.loads(Path(sys.argv[1]).read_text())
    if len(sys.argv) == 3:
        write(record, Path(sys.argv[2]))
    else:
        print(render(record))


if __name__ == "__main__":
    main()
