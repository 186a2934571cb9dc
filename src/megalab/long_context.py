"""Unlimited-context evaluation: score a document of any length in segments with the carried
state, in bounded memory, and report perplexity per context-position bucket.

    megalab-eval mode=long_context ckpt_path=<ckpt> [long_context.split=test
        long_context.max_tokens=2000000 long_context.segment_len=4096]

This is Megalodon's Fig. 5 (perplexity against context length, 4K to 2M tokens; also Mega
Fig. 6, LaMemo Fig. 5) as one streaming pass: the split's token stream is read as one document
(`rows=1`; or `rows` documents cut from it), `segment_len` tokens per forward pass, the
backbone's state carried from each segment to the next, and the loss of the token at position
p attributed to the bucket holding p: [0, 4K), [4K, 8K), [8K, 16K), ... (edges doubling from
`first_bucket`). A token in a later bucket is predicted with a longer context, so a model that
uses its context shows perplexity falling bucket after bucket.

The long document: PG-19's books concatenated in order (the data module's split stream, each
book followed by `<eos>`); the paper's validation set of 1,920 books of at least 2M tokens each
is not public, so this is the proxy. Memory: only one segment's activations and the state are
held; the state is constant in size for Mega and Megalodon (EMA / CEMA state, timestep-norm
statistics, the open chunk's keys and values) and grows with the context for Llama's key/value
cache (`state_bytes` in the record shows which). A stateless backbone (the Transformer) starts
every segment afresh: its buckets measure no context beyond a segment.

`norm_refresh_after` (off by default) is the authors' periodic re-estimation of the timestep-norm
statistics in their evaluation code (not in the paper): once the statistics cover that many
tokens, they are recomputed by a fresh pass over the last `norm_refresh_window` tokens and
swapped into the state (CEMA state and key/value cache kept). The reference uses 8 and 6 chunks
of 2,048 (16,384 and 12,288 tokens) with segments of 2 chunks. It needs a backbone with
timestep-norm statistics, which overrides `Backbone.refresh_norm_state(state, fresh_state)`
(the default refuses).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from megalab.nn.modes import in_evaluation_mode
from megalab.nn.state import map_state

if TYPE_CHECKING:
    from megalab.tasks.language_modeling import LanguageModelingTask

log = logging.getLogger(__name__)


def bucket_edges(first: int, length: int) -> list[int]:
    """[0, first, 2·first, 4·first, ...] up to and including `length` (the last edge)."""
    if first < 1:
        raise ValueError(f"first_bucket must be positive, got {first}")
    edges = [0]
    edge = first
    while edge < length:
        edges.append(edge)
        edge *= 2
    edges.append(length)
    return edges


def state_bytes(state: Any) -> int:
    """Bytes held by the tensors of a carried state."""
    total = [0]

    def add(t: Tensor) -> Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    map_state(state, add)
    return total[0]


def peak_rss_mb() -> float:
    """The process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class Bucket:
    start: int
    end: int
    tokens: int = 0
    nll: float = 0.0
    words: int = 0

    def summary(self) -> dict[str, Any]:
        loss = self.nll / self.tokens if self.tokens else float("nan")
        out: dict[str, Any] = {
            "start": self.start,
            "end": self.end,
            "tokens": self.tokens,
            "loss": loss,
            "ppl": math.exp(min(loss, 50.0)) if self.tokens else float("nan"),
        }
        if self.words:
            out["words"] = self.words
            out["word_ppl"] = math.exp(min(self.nll / self.words, 50.0))
        return out


@dataclass
class LongContextResult:
    buckets: list[dict[str, Any]]
    tokens: int
    loss: float
    ppl: float
    seconds: float
    tokens_per_sec: float
    state_bytes_first: int
    state_bytes_max: int
    peak_rss_mb_before: float
    peak_rss_mb: float
    settings: dict[str, Any] = field(default_factory=dict)


@torch.inference_mode()
@in_evaluation_mode
def score_stream(
    task: LanguageModelingTask,
    tokens: np.ndarray,
    words: np.ndarray | None = None,
    segment_len: int = 4096,
    first_bucket: int = 4096,
    rows: int = 1,
    norm_refresh_after: int | None = None,
    norm_refresh_window: int | None = None,
    device: torch.device | str = "cpu",
) -> LongContextResult:
    """Score `tokens` (a 1-D stream: position p predicts p + 1) as `rows` documents of equal
    length, segment by segment with the carried state; see the module docstring. The task
    scores in evaluation mode and is given back in the mode it came in."""
    if segment_len < 1 or rows < 1:
        raise ValueError("segment_len and rows must be positive")
    if norm_refresh_after is not None and not (
        norm_refresh_window and 0 < norm_refresh_window <= norm_refresh_after
    ):
        raise ValueError(
            "norm_refresh_window must be positive and at most norm_refresh_after "
            f"(got {norm_refresh_window} and {norm_refresh_after})"
        )
    length = (len(tokens) - 1) // rows  # predictions per document
    if length < 1:
        raise ValueError(f"{len(tokens)} tokens cannot make {rows} document(s) to score")
    backbone = task.backbone
    from megalab.tasks.language_modeling import check_no_extended_context

    check_no_extended_context(backbone, "long-context scoring")
    edges = bucket_edges(first_bucket, length)
    buckets = [Bucket(a, b) for a, b in itertools.pairwise(edges)]
    like = next(task.parameters())
    state = backbone.initial_state(rows, like)
    starts = np.arange(rows, dtype=np.int64) * length
    rss_before = peak_rss_mb()
    first_bytes = max_bytes = 0
    covered = 0  # tokens the norm statistics cover
    t0 = time.perf_counter()
    for a in range(0, length, segment_len):
        width = min(segment_len, length - a)
        index = starts[:, None] + a + np.arange(width)[None, :]
        inputs = torch.as_tensor(np.asarray(tokens[index], dtype=np.int64), device=device)
        targets = torch.as_tensor(np.asarray(tokens[index + 1], dtype=np.int64), device=device)
        out = task(inputs, None, state)
        nll = task.head.nll(out.y, targets).double().sum(0).cpu().numpy()  # (width,)
        state = out.state
        if state is not None:
            size = state_bytes(state)
            first_bytes = first_bytes or size
            max_bytes = max(max_bytes, size)
        wcount = None if words is None else np.asarray(words[index + 1], dtype=np.int64).sum(0)
        positions = a + np.arange(width)
        for bucket in buckets:
            sel = (positions >= bucket.start) & (positions < bucket.end)
            if sel.any():
                bucket.tokens += int(sel.sum()) * rows
                bucket.nll += float(nll[sel].sum())
                if wcount is not None:
                    bucket.words += int(wcount[sel].sum())
        covered += width
        if norm_refresh_after is not None and state is not None and covered >= norm_refresh_after:
            assert norm_refresh_window is not None  # validated with norm_refresh_after above
            lo = a + width - norm_refresh_window
            recent = starts[:, None] + lo + np.arange(norm_refresh_window)[None, :]
            recent_t = torch.as_tensor(np.asarray(tokens[recent], dtype=np.int64), device=device)
            fresh = task(recent_t, None, backbone.initial_state(rows, like)).state
            state = backbone.refresh_norm_state(state, fresh)
            covered = norm_refresh_window
    seconds = time.perf_counter() - t0
    total_nll = sum(b.nll for b in buckets)
    total = sum(b.tokens for b in buckets)
    loss = total_nll / total
    return LongContextResult(
        buckets=[b.summary() for b in buckets],
        tokens=total,
        loss=loss,
        ppl=math.exp(min(loss, 50.0)),
        seconds=round(seconds, 3),
        tokens_per_sec=round(total / seconds, 1) if seconds > 0 else float("nan"),
        state_bytes_first=first_bytes,
        state_bytes_max=max_bytes,
        peak_rss_mb_before=round(rss_before, 1),
        peak_rss_mb=round(peak_rss_mb(), 1),
        settings={
            "segment_len": segment_len,
            "first_bucket": first_bucket,
            "rows": rows,
            "norm_refresh_after": norm_refresh_after,
            "norm_refresh_window": norm_refresh_window,
        },
    )


def _label(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return f"{n:,}"


def plot_buckets(result: LongContextResult, path: Path, title: str = "") -> Path:
    """Perplexity per context-position bucket (x: bucket end, log scale) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ends = [b["end"] for b in result.buckets if b["tokens"]]
    key = "word_ppl" if all("word_ppl" in b for b in result.buckets if b["tokens"]) else "ppl"
    values = [b[key] for b in result.buckets if b["tokens"]]
    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=150)
    ax.plot(ends, values, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ends)
    ax.set_xticklabels([_label(e) for e in ends], rotation=45)
    ax.set_xlabel("context position (bucket end, tokens)")
    ax.set_ylabel("word perplexity" if key == "word_ppl" else "perplexity")
    ax.set_title(title or "perplexity per context-position bucket")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def evaluate_long_context(cfg: Any) -> dict[str, Any]:
    """`megalab-eval mode=long_context`: load the checkpoint, score the split, write
    `long_context.json` and `long_context.png` into the output folder; return the record."""
    import hydra

    from megalab.run_loading import check_run_vocabulary, load_task, pick_device

    opts = cfg.long_context
    device = pick_device(str(opts.get("device", "auto")))
    task = load_task(cfg, device, torch.float32, "megalab-eval mode=long_context")
    datamodule = hydra.utils.instantiate(cfg.data)
    check_run_vocabulary(cfg, datamodule, "megalab-eval mode=long_context")
    streams = datamodule.load_streams()
    split = str(opts.split)
    if split not in streams:
        raise ValueError(f"no {split!r} split in {type(datamodule).__name__}: {sorted(streams)}")
    stream = streams[split]
    n = len(stream) if opts.get("max_tokens") is None else min(len(stream), opts.max_tokens + 1)
    tokens = stream.tokens[:n]
    words = None
    if stream.words_per_token:
        words = np.ones(n, dtype=np.uint8)
    elif stream.words is not None:
        words = stream.words[:n]
    result = score_stream(
        task,
        tokens,
        words,
        segment_len=int(opts.segment_len),
        first_bucket=int(opts.first_bucket),
        rows=int(opts.rows),
        norm_refresh_after=opts.get("norm_refresh_after"),
        norm_refresh_window=opts.get("norm_refresh_window"),
        device=device,
    )
    out_dir = Path(cfg.paths.output_dir)
    record = {"ckpt_path": str(cfg.ckpt_path), "split": split, **asdict(result)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "long_context.json").write_text(json.dumps(record, indent=2) + "\n")
    name = type(task.backbone).__name__
    plot_buckets(result, out_dir / "long_context.png", f"{name}: {split}, {result.tokens:,} tokens")
    for b in result.buckets:
        log.info("[%s, %s): %s tokens, ppl %.3f", b["start"], b["end"], b["tokens"], b["ppl"])
    log.info(
        "%s tokens in %.1f s; state %s -> %s bytes; peak RSS %.0f MB",
        f"{result.tokens:,}",
        result.seconds,
        result.state_bytes_first,
        result.state_bytes_max,
        result.peak_rss_mb,
    )
    return record
