"""Language-model token streams and the batches recurrent and stateless models train on.

A split is one token stream `s[0..N)`; the model predicts `s[p]` from `s[<p]` for p = 1..N-1
(word-level corpora store a leading `<eos>` so that every real token is predicted). Three batch
orders are built from it, each a pure function of (seed, epoch, batch index, rank) so that a
resumed run continues exactly:

- `StreamBatches` (training, Transformer-XL order): the N-1 predictions are cut into R equal
  contiguous rows (the remainder is dropped), R = global batch; consecutive batches are
  consecutive segments of length L of the same rows, so a model can carry its state from one
  batch to the next (`reset` is True on the first batch of every epoch). Each epoch rolls the
  stream by a seeded random offset (wrapping around), so the rows start at new places; with
  `roll="rows"` each row is instead rotated within itself by its own offset, as XL's
  `LMOrderedIterator.roll` does (every row keeps its part of the corpus; the pairs stay
  adjacent tokens, where XL also scores the one wrap-around pair of each row). With
  `ext_len` E > 0 every segment after the first of a row also carries the E tokens before it
  as extended context (XL's `ext_len`: attended, not scored, `target_mask` False there).
- `EvalBatches`: the predictions are cut into R rows that cover them all (lengths differ by at
  most one); segments run in order with carried state, the last one partial and padded, and
  `target_mask` marks what is scored: every token is predicted exactly once (`ext_len` as in
  training: up to E unscored tokens of context before each later segment). With a stride S,
  sliding windows instead: each window holds up to L - S tokens of context before S new
  tokens, only the new ones are scored, and every window starts afresh (`reset` True).
- `RandomWindowBatches` (training for stateless models): independent uniformly drawn windows,
  optionally of a length m x unit with m drawn per step (Mega's variable-length blocks).

Under DDP each rank takes its own rows (training: equal numbers, disjoint; evaluation: the
global rows split across ranks), with gradient accumulation the micro-batches of one step take
different rows ("stream groups", `stream_group` in the batch) so each group's state is carried
separately. Lightning's distributed sampler stays off: the module shards data itself.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megalab.batch import Batch
from megalab.data.base import SequenceDataModule, ShardedSampler

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
SAMPLERS = ("stream", "random")
ROLLS = (True, False, "rows")


# --------------------------------------------------------------------------- token streams


class TokenStream:
    """One split: a 1-D token array, memory-mapped from a raw `.bin` file or held in memory.

    `words` (optional, same length) counts the words that start in each token, for word-level
    perplexity with subword vocabularies; `words="tokens"` counts every token as a word
    (WikiText-103's convention). Memory maps are opened lazily in each process, so the stream
    pickles cheaply into DataLoader workers.
    """

    def __init__(
        self,
        tokens: np.ndarray | str | os.PathLike[str],
        *,
        dtype: str | None = None,
        length: int | None = None,
        words: np.ndarray | str | os.PathLike[str] | None = None,
        words_per_token: bool = False,
        max_id: int | None = None,
        name: str = "",
    ) -> None:
        self.name = name
        self.words_per_token = words_per_token
        self._tokens: np.ndarray | None = None
        self._words: np.ndarray | None = None
        self._path = self._words_path = None
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1:
                raise ValueError(f"a token stream must be 1-D, got shape {tokens.shape}")
            self._tokens, self.dtype, self.length = tokens, str(tokens.dtype), len(tokens)
        else:
            if dtype is None or length is None:
                raise ValueError("a token file needs its dtype and length")
            self._path, self.dtype, self.length = Path(tokens), dtype, int(length)
        if isinstance(words, np.ndarray):
            self._words = words
        elif words is not None:
            self._words_path = Path(words)
        self.max_id = max_id

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._path is not None:
            state["_tokens"] = None
        if self._words_path is not None:
            state["_words"] = None
        return state

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            assert self._path is not None, "a stream without tokens has a file"
            self._tokens = np.memmap(self._path, dtype=self.dtype, mode="r", shape=(self.length,))
        return self._tokens

    @property
    def has_words(self) -> bool:
        return self.words_per_token or self._words is not None or self._words_path is not None

    @property
    def words(self) -> np.ndarray | None:
        if self._words is None and self._words_path is not None:
            self._words = np.memmap(
                self._words_path, dtype=np.uint8, mode="r", shape=(self.length,)
            )
        return self._words

    def take(self, index: np.ndarray) -> np.ndarray:
        """Tokens at `index` (any shape) as int64."""
        return np.asarray(self.tokens[index], dtype=np.int64)

    def word_count(self, index: np.ndarray, scored: np.ndarray) -> int:
        """Words covered by the scored target positions `index[scored]`."""
        if self.words_per_token:
            return int(scored.sum())
        words = self.words
        if words is None:
            return 0
        return int(np.asarray(words[index[scored]], dtype=np.int64).sum())

    def compute_max_id(self) -> int:
        if self.max_id is None:
            self.max_id = int(self.tokens.max()) if self.length else -1
        return self.max_id


# --------------------------------------------------------------------------- writing streams


def load_streams(cache: Path, vocab_size: int | None = None) -> dict[str, TokenStream]:
    """The `TokenStream`s of a prepared directory (from its `meta.json`).

    Cheap checks first (`megalab.data.cache`): each token file has the size its token count
    and dtype give, and the largest id recorded at preparation is below `vocab_size`.
    """
    from megalab.data.cache import CacheError, rebuild_hint

    try:
        meta = json.loads((cache / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise CacheError(
            f"{cache / 'meta.json'} is unreadable ({err}). {rebuild_hint(cache)}"
        ) from None
    streams = {}
    for split, info in meta["splits"].items():
        path = cache / info["file"]
        want = int(info["tokens"]) * np.dtype(info["dtype"]).itemsize
        size = path.stat().st_size if path.exists() else -1
        if size != want:
            raise CacheError(
                f"{path} has {size:,} bytes, {want:,} expected ({info['tokens']:,} "
                f"{info['dtype']} tokens). {rebuild_hint(cache)}"
            )
        max_id = info.get("max_id")
        if vocab_size is not None and max_id is not None and max_id >= vocab_size:
            raise CacheError(
                f"{path} holds token ids up to {max_id}, beyond the vocabulary of {vocab_size} "
                f"(data.vocab_size). {rebuild_hint(cache)}"
            )
        words = info.get("words_file")
        streams[split] = TokenStream(
            path,
            dtype=info["dtype"],
            length=info["tokens"],
            words=None if not words else cache / words,
            words_per_token=info.get("words_per_token", False),
            max_id=max_id,
            name=split,
        )
    return streams


# --------------------------------------------------------------------------- batch layouts


@dataclass(frozen=True)
class Layout:
    """Where this process sits: its rank, the world size and gradient-accumulation groups."""

    rank: int = 0
    world_size: int = 1
    accumulate: int = 1

    def first_row(self, group: int, rows: int) -> int:
        """Global number of this process's first row in stream group `group` when every
        process takes `rows` rows of each group (groups first, then ranks)."""
        return (group * self.world_size + self.rank) * rows


def _batch(
    stream: TokenStream,
    index: np.ndarray,
    target_index: np.ndarray,
    valid: np.ndarray,
    scored: np.ndarray,
    reset: bool,
    group: int,
    words: bool,
) -> Batch:
    """Batch dict for input positions `index` and target positions `target_index` (R, W)."""
    index = np.where(valid, index, 0)
    target_index = np.where(valid, target_index, 0)
    batch: Batch = {
        "inputs": torch.from_numpy(np.where(valid, stream.take(index), 0)),
        "targets": torch.from_numpy(np.where(valid, stream.take(target_index), 0)),
        "mask": torch.from_numpy(valid.copy()),
        "target_mask": torch.from_numpy(scored.copy()),
        # Python values, not tensors: the task reads them before the forward, and a value moved
        # to the GPU with the batch would cost a host sync to read back.
        "reset": bool(reset),
        "stream_group": int(group),
    }
    if words:
        batch["num_words"] = torch.tensor(
            stream.word_count(target_index, scored), dtype=torch.float64
        )
    return batch


def extended_offsets(a: int, width: int, ext_len: int) -> np.ndarray:
    """Offsets (1, e + width) of a segment starting at row offset `a`: e = min(ext_len, a)
    positions of extended context (negative offsets) before the segment's own `width`.

    Transformer-XL's `LMOrderedIterator.get_batch` reads `data[max(0, i - ext_len) : i + L]`
    and predicts only the last L targets; its memory then stops `ext_len` positions before the
    end of each segment (`_update_mems`), exactly where the next segment's context begins.
    """
    return np.arange(-min(ext_len, a), width)[None, :]


@dataclass(eq=False)
class _TrainingBatches(Dataset):
    """Training batches addressed by `(epoch, i)`: `rows_per_device` rows of up to `seq_len`
    tokens of `stream` per process, in `layout`'s processes and accumulation groups.

    A dataclass so that subclasses declare only their own settings, and check them in
    `__post_init__`; everything after `layout` is keyword-only.
    """

    stream: TokenStream
    rows_per_device: int
    seq_len: int
    layout: Layout = Layout()
    seed: int = field(default=0, kw_only=True)
    #: The rows of one optimizer step, over every process and accumulation group.
    total_rows: int = field(init=False)

    def __post_init__(self) -> None:
        self.total_rows = self.rows_per_device * self.layout.world_size * self.layout.accumulate


@dataclass(eq=False)
class StreamBatches(_TrainingBatches):
    """Training batches in Transformer-XL order: B contiguous rows read in segments of L.

    Items are addressed by `(epoch, i)`; batch i is segment `i // accumulate` of stream group
    `i % accumulate`. `roll` rotates the whole stream by a per-epoch random offset first.
    `ext_len` prepends up to that many earlier tokens of the row to every later segment,
    unscored (see `extended_offsets`).
    """

    roll: bool | str = field(default=True, kw_only=True)
    ext_len: int = field(default=0, kw_only=True)
    row_len: int = field(init=False)
    segments: int = field(init=False)

    def __post_init__(self) -> None:
        if self.roll not in ROLLS:
            raise ValueError(f"unknown roll {self.roll!r}: true (the stream), false or 'rows'")
        if self.ext_len < 0:
            raise ValueError(f"ext_len must be >= 0, got {self.ext_len}")
        super().__post_init__()
        n_pred = len(self.stream) - 1
        self.row_len = n_pred // self.total_rows
        if self.row_len < 1:
            raise ValueError(
                f"the {self.stream.name or 'training'} split has {n_pred} predictions, fewer "
                f"than the {self.total_rows} rows of a global batch: lower data.batch_size"
            )
        self.segments = -(-self.row_len // self.seq_len)

    def __len__(self) -> int:
        return self.segments * self.layout.accumulate

    def row_shifts(self, epoch: int) -> np.ndarray:
        """Per global row, its rotation in this epoch (`roll="rows"`)."""
        rng = np.random.default_rng([self.seed, 7919, epoch])
        return rng.integers(self.row_len, size=self.total_rows)

    def offset(self, epoch: int) -> int:
        if self.roll is not True:
            return 0
        return int(np.random.default_rng([self.seed, 104729, epoch]).integers(len(self.stream)))

    def row_ids(self, group: int) -> np.ndarray:
        """Global row numbers of this rank's rows in stream group `group`."""
        first = self.layout.first_row(group, self.rows_per_device)
        return np.arange(first, first + self.rows_per_device)

    def __getitem__(self, key: tuple[int, int]) -> Batch:
        epoch, i = key
        segment, group = divmod(i, self.layout.accumulate)
        a = segment * self.seq_len
        width = min(self.seq_len, self.row_len - a)
        rows = self.row_ids(group)
        offs = extended_offsets(a, width, self.ext_len)
        if self.roll == "rows":
            local = (self.row_shifts(epoch)[rows, None] + a + offs) % self.row_len
            positions = rows[:, None] * self.row_len + local
        else:
            starts = rows * self.row_len + a
            positions = self.offset(epoch) + starts[:, None] + offs
        n = len(self.stream)
        valid = np.ones(positions.shape, dtype=bool)
        return _batch(
            self.stream,
            positions % n,
            (positions + 1) % n,
            valid,
            np.broadcast_to(offs >= 0, valid.shape),
            segment == 0,
            group,
            words=False,
        )


class EvalBatches(Dataset):
    """Evaluation batches covering every prediction of a split exactly once.

    The N-1 predictions are split into `rows` contiguous rows (lengths differ by at most one)
    and this rank takes its share of them. Without `stride`: consecutive segments of length
    `seq_len` with carried state (`reset` on the first), each later one after up to `ext_len`
    unscored tokens of extended context. With `stride` S: windows of up to `seq_len` tokens
    whose last S (new) tokens are scored, each with `reset`.
    """

    def __init__(
        self,
        stream: TokenStream,
        rows: int,
        seq_len: int,
        layout: Layout = Layout(),
        stride: int | None = None,
        words: bool = False,
        ext_len: int = 0,
    ) -> None:
        n_pred = len(stream) - 1
        if n_pred < 1:
            raise ValueError(f"the {stream.name} split has no token to predict")
        rows = min(rows, n_pred)
        if layout.world_size > rows:
            raise ValueError(
                f"{rows} evaluation stream(s) of the {stream.name} split cannot be shared by "
                f"{layout.world_size} processes: raise data.eval_batch_size to at least the "
                "number of processes"
            )
        if stride is not None and not 0 < stride <= seq_len:
            raise ValueError(f"eval_stride={stride} must be in [1, eval segment length {seq_len}]")
        if ext_len < 0:
            raise ValueError(f"ext_len must be >= 0, got {ext_len}")
        if ext_len and stride is not None:
            raise ValueError(
                "ext_len (extended context before carried-state segments) and eval_stride "
                "(sliding windows, which have their own context) exclude each other: set one"
            )
        self.stream, self.seq_len, self.stride, self.words = stream, seq_len, stride, words
        self.ext_len = ext_len
        bounds = np.linspace(0, n_pred, rows + 1).round().astype(np.int64)
        lengths = np.diff(bounds)
        mine = np.array_split(np.arange(rows), layout.world_size)[layout.rank]
        self.starts, self.lengths = bounds[:-1][mine], lengths[mine]
        step = stride or seq_len
        self.num_batches = int(-(-int(lengths.max()) // step))

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, key: tuple[int, int]) -> Batch:
        _, t = key
        if self.stride is None:
            a = t * self.seq_len
            width = min(self.seq_len, int(self.lengths.max()) - a) if len(self.lengths) else 0
            width = max(width, 1)
            offs = extended_offsets(a, width, self.ext_len)
            # A row that has ended takes no context either (its carried stream is over).
            valid = (a + offs < self.lengths[:, None]) & (self.lengths > a)[:, None]
            index = self.starts[:, None] + a + offs
            scored = valid & (offs >= 0)
            return _batch(self.stream, index, index + 1, valid, scored, t == 0, 0, self.words)
        S, context = self.stride, self.seq_len - self.stride
        new_start = self.starts + t * S  # absolute input positions of the new tokens
        new_len = np.clip(self.lengths - t * S, 0, S)
        ctx_start = np.maximum(new_start - context, 0)
        ctx_len = new_start - ctx_start
        width = max(int((ctx_len + new_len).max()), 1)
        offs = np.arange(width)[None, :]
        valid = offs < (ctx_len + new_len)[:, None]
        scored = valid & (offs >= ctx_len[:, None])
        index = ctx_start[:, None] + offs
        return _batch(self.stream, index, index + 1, valid, scored, True, 0, self.words)


def check_window_multiples(multiples: Sequence[int] | None, unit: int | None, max_len: int) -> None:
    """Variable-length windows of m x `unit` tokens, m in [lo, hi], fit in `max_len`."""
    if multiples is None:
        return
    lo, hi = multiples
    if unit is None or not 1 <= lo <= hi or hi * unit > max_len:
        raise ValueError(
            f"train_len_multiples={list(multiples)} with train_len_unit={unit} must give "
            f"windows of at most data.max_len={max_len} tokens"
        )


@dataclass(eq=False)
class RandomWindowBatches(_TrainingBatches):
    """Independent random windows (stateless training); every batch has `reset`.

    `multiples=(lo, hi)` draws m uniformly from lo..hi per optimizer step (the same on every
    rank) and uses windows of m x `unit` tokens, `seq_len // (m x unit)` times as many rows, so
    each step holds about the same number of tokens (fairseq's max-tokens batching).
    """

    multiples: tuple[int, ...] | None = field(default=None, kw_only=True)
    unit: int | None = field(default=None, kw_only=True)
    steps: int = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window_multiples(self.multiples, self.unit, self.seq_len)
        n_pred = len(self.stream) - 1
        longest = self.seq_len
        if n_pred < longest:
            raise ValueError(
                f"the {self.stream.name or 'training'} split has {n_pred} predictions, fewer "
                f"than one window of {longest}: lower data.max_len"
            )
        self.steps = max(1, n_pred // (self.total_rows * self.seq_len))

    def __len__(self) -> int:
        return self.steps * self.layout.accumulate

    def window(self, epoch: int, step: int) -> tuple[int, np.random.Generator]:
        rng = np.random.default_rng([self.seed, 15485863, epoch, step])
        if self.multiples is None:
            return self.seq_len, rng
        m = int(rng.integers(self.multiples[0], self.multiples[1] + 1))
        assert self.unit is not None, "variable-length windows have a unit"
        return m * self.unit, rng

    def __getitem__(self, key: tuple[int, int]) -> Batch:
        epoch, i = key
        step, group = divmod(i, self.layout.accumulate)
        length, rng = self.window(epoch, step)
        rows = self.rows_per_device * (self.seq_len // length)
        total = rows * self.layout.world_size * self.layout.accumulate
        starts = rng.integers(0, len(self.stream) - length, size=total)
        first = self.layout.first_row(group, rows)
        index = starts[first : first + rows, None] + np.arange(length)[None, :]
        valid = np.ones(index.shape, dtype=bool)
        return _batch(self.stream, index, index + 1, valid, valid, True, group, words=False)


class BatchIndexSampler(ShardedSampler):
    """Yields `(epoch, i)` for the batches of an epoch, skipping those done before a resume."""

    def __init__(self, num_batches: int) -> None:
        super().__init__(num_batches, shuffle=False)

    # (epoch, batch) pairs where ShardedSampler yields plain indices
    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        return ((self.epoch, i) for i in range(self.skip, self.size))


# --------------------------------------------------------------------------- the DataModule


class LMStreamDataModule(SequenceDataModule):
    """Base DataModule of the language-model datasets (enwik8, text8, WikiText-103, PG-19).

    Subclasses prepare their splits in `prepare_data` and return them from `load_streams`.

    Args:
        max_len: training segment (or window) length L; the spec's `max_len`.
        batch_size: global number of rows (streams) per optimizer step.
        eval_batch_size: global number of evaluation streams (independent of the number of
            processes, so results do not depend on it).
        sampler: `stream` (contiguous rows, Transformer-XL order, for models that carry
            state) or `random` (independent random windows, for stateless models); kept as
            `train_sampling`.
        roll: rotate the training stream by a random offset each epoch (`stream` sampler);
            "rows": rotate each row within itself instead (Transformer-XL's `--roll`).
        eval_max_len: evaluation segment/window length (default: max_len).
        eval_stride: sliding-window evaluation: score this many new tokens per window of
            `eval_max_len` (None: consecutive segments with carried state).
        train_len_multiples, train_len_unit: variable-length windows m x unit, m uniform in
            [lo, hi] per step (`random` sampler; Mega's variant blocks).
        ext_len: up to this many earlier tokens of the row before every later segment,
            unscored, in training and evaluation (Transformer-XL's `ext_len`; the backbone's
            `ext_len` must match).
        kwargs: `SequenceDataModule`'s other settings; of the spec, `vocab_size` (required) and
            `pad_id` (`d_input`/`num_classes` must stay None for LM data).
    """

    word_level: bool = False

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int,
        batch_size: int = 8,
        sampler: str = "stream",
        roll: bool | str = True,
        eval_max_len: int | None = None,
        eval_stride: int | None = None,
        train_len_multiples: list[int] | tuple[int, int] | None = None,
        train_len_unit: int | None = None,
        ext_len: int = 0,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("d_input") is not None or kwargs.get("num_classes") is not None:
            raise ValueError(
                "language-model data has tokens and no classes: set data.d_input "
                "and data.num_classes to null"
            )
        vocab_size = kwargs.get("vocab_size")
        if vocab_size is None or vocab_size <= 0:
            raise ValueError(f"language-model data needs a positive vocab_size, got {vocab_size}")
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; choose one of {SAMPLERS}")
        if train_len_multiples is not None and sampler != "random":
            raise ValueError("train_len_multiples (variable-length windows) needs sampler=random")
        if max_len < 1:
            raise ValueError(f"max_len must be positive, got {max_len}")
        # Here, before a trainer starts its processes, not when training asks for batches.
        check_window_multiples(train_len_multiples, train_len_unit, max_len)
        if ext_len < 0:
            raise ValueError(f"ext_len must be >= 0, got {ext_len}")
        if ext_len and sampler != "stream":
            raise ValueError(
                "ext_len extends carried-state segments with the tokens before them: it needs "
                "sampler=stream (random windows have no preceding segment)"
            )
        super().__init__(data_dir, max_len, batch_size, **kwargs)
        # Not `self.sampler`: that would shadow SequenceDataModule.sampler(split, batch_size).
        self.train_sampling = sampler
        self.roll = roll
        self.eval_max_len = eval_max_len or max_len
        self.eval_stride = eval_stride
        self.train_len_multiples = (
            None if train_len_multiples is None else tuple(int(m) for m in train_len_multiples)
        )
        self.train_len_unit = train_len_unit
        self.ext_len = ext_len

    # -- hooks for subclasses -------------------------------------------------------------------
    def load_streams(self) -> dict[str, TokenStream]:
        """The prepared `train`/`val`/`test` streams (prepare first when needed)."""
        raise NotImplementedError

    def text_codec(self) -> Any:
        """Text <-> ids with this dataset's vocabulary (`megalab.data.lm.codec`), for prompts."""
        raise NotImplementedError(f"{type(self).__name__} has no text codec")

    # -- setup ----------------------------------------------------------------------------------
    def build_datasets(self) -> dict[str, TokenStream]:
        streams = self.load_streams()
        missing = [s for s in SPLITS if s not in streams]
        if missing:
            raise ValueError(f"{type(self).__name__}: no {', '.join(missing)} split prepared")
        for split, stream in streams.items():
            if len(stream) < 2:
                raise ValueError(
                    f"{type(self).__name__}: the {split} split has {len(stream)} token(s) in "
                    f"{self.data_dir}: at least 2 are needed (check the files or split sizes)"
                )
            top = stream.compute_max_id()
            assert self.spec.vocab_size is not None  # checked in __init__
            if top >= self.spec.vocab_size:
                raise ValueError(
                    f"{type(self).__name__}: the {split} split holds token id {top}, outside the "
                    f"vocabulary of data.vocab_size={self.spec.vocab_size}; set data.vocab_size "
                    f"to at least {top + 1} (or re-prepare the data with the right vocabulary)"
                )
        return dict(streams)

    def layout(self, train: bool) -> Layout:
        rank, world = self.rank_and_world()
        accumulate = self.trainer.accumulate_grad_batches if (train and self.trainer) else 1
        return Layout(rank, world, accumulate)

    def batches(
        self, split: str, layout: Layout | None = None
    ) -> EvalBatches | RandomWindowBatches | StreamBatches:
        """The batch dataset of `split` for a process at `layout` (its rank, world, groups)."""
        if split not in self.datasets:
            self.setup()
        stream = self.datasets[split]
        train = split == "train"
        layout = layout or self.layout(train)
        if not train:
            rows = self.eval_batch_size or self.batch_size
            return EvalBatches(
                stream,
                rows,
                self.eval_max_len,
                layout,
                self.eval_stride,
                words=self.word_level and stream.has_words,
                ext_len=self.ext_len,
            )
        parts = layout.world_size * layout.accumulate
        if self.batch_size % parts:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by world_size x "
                f"accumulate_grad_batches = {layout.world_size} x {layout.accumulate}; choose "
                "a batch size that is"
            )
        rows = self.batch_size // parts
        if self.train_sampling == "random":
            return RandomWindowBatches(
                stream,
                rows,
                self.max_len,
                layout,
                seed=self.seed,
                multiples=self.train_len_multiples,
                unit=self.train_len_unit,
            )
        return StreamBatches(
            stream, rows, self.max_len, layout, seed=self.seed, roll=self.roll, ext_len=self.ext_len
        )

    def _loader(self, split: str, train: bool) -> DataLoader:
        dataset = self.batches(split)
        # The batches are prepared whole: one per index, no collation.
        return self.loader(
            dataset,
            train=train,
            batch_size=None,
            sampler=BatchIndexSampler(len(dataset)),
            collate_fn=None,
        )

    def describe(self) -> str:
        """One line per split: tokens and what one epoch of it is."""
        lines = []
        for split in SPLITS:
            ds = self.batches(split, Layout())
            lines.append(f"{split}: {len(self.datasets[split]):,} tokens, {len(ds):,} batches")
        return "; ".join(lines)
