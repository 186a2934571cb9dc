"""Datasets and batches as fairseq's translation task makes them: flat id arrays, batches of at
most `max_tokens` tokens packed by length, dealt to the processes in a per-epoch seeded order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from megalab.data.wmt.text import PAD_ID


class ParallelSentences(Dataset):
    """Source and target ids stored flat (one int32 array per side plus offsets)."""

    def __init__(self, src: np.ndarray, src_offsets: np.ndarray, tgt: np.ndarray,
                 tgt_offsets: np.ndarray) -> None:  # fmt: skip
        if len(src_offsets) != len(tgt_offsets):
            raise ValueError("source and target have different numbers of sentences")
        self.src, self.src_offsets, self.tgt, self.tgt_offsets = src, src_offsets, tgt, tgt_offsets

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    def src_sizes(self) -> np.ndarray:
        return np.diff(self.src_offsets)

    def tgt_sizes(self) -> np.ndarray:
        return np.diff(self.tgt_offsets)

    def lengths(self) -> np.ndarray:
        """fairseq's `num_tokens`: the longer side."""
        return np.maximum(self.src_sizes(), self.tgt_sizes())

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = np.asarray(self.src[self.src_offsets[i] : self.src_offsets[i + 1]], dtype=np.int64)
        t = np.asarray(self.tgt[self.tgt_offsets[i] : self.tgt_offsets[i + 1]], dtype=np.int64)
        return {"source": torch.from_numpy(s), "target": torch.from_numpy(t), "index": i}


def batch_by_size(
    indices: Sequence[int] | np.ndarray,
    num_tokens: np.ndarray,
    max_tokens: int | None,
    max_sentences: int | None,
    multiple: int = 1,
) -> list[list[int]]:
    """fairseq's `data_utils.batch_by_size`: greedy batches in the order of `indices`.

    A batch is full when it holds `max_sentences` examples or one more would make
    (examples x longest) exceed `max_tokens`; a full batch is cut to a multiple of `multiple`
    and the rest starts the next one.
    """
    max_tokens = max_tokens or -1
    max_sentences = max_sentences or -1
    batches: list[list[int]] = []
    batch: list[int] = []
    lens: list[int] = []
    longest = 0
    for idx in indices:
        n = int(num_tokens[idx])
        if 0 < max_tokens < n:
            raise ValueError(
                f"example {idx} has {n} tokens, more than max_tokens={max_tokens} per batch: "
                "raise data.max_tokens or filter longer sentences"
            )
        lens.append(n)
        longest = max(longest, n)
        full = bool(batch) and (
            (max_sentences > 0 and len(batch) == max_sentences)
            or (max_tokens > 0 and (len(batch) + 1) * longest > max_tokens)
        )
        if full:
            cut = max(multiple * (len(batch) // multiple), len(batch) % multiple)
            batches.append(batch[:cut])
            batch, lens = batch[cut:], lens[cut:]
            longest = max(lens) if lens else 0
        batch.append(int(idx))
    if batch:
        batches.append(batch)
    return batches


def ordered_indices(dataset: ParallelSentences, shuffle: bool, seed: int) -> np.ndarray:
    """fairseq's `LanguagePairDataset.ordered_indices`: a seeded shuffle (training), then a
    stable sort by target length, then by source length."""
    n = len(dataset)
    indices = np.random.RandomState(seed).permutation(n) if shuffle else np.arange(n)
    indices = indices[np.argsort(dataset.tgt_sizes()[indices], kind="mergesort")]
    return indices[np.argsort(dataset.src_sizes()[indices], kind="mergesort")]


class TokenBatchSampler(Sampler[list[int]]):
    """One process's batches of a fixed set (`batch_by_size`), in a per-epoch seeded order.

    Training batches are reshuffled every epoch (`set_epoch`) and dealt round-robin to the
    processes, the list wrapped around so every process takes the same number of steps;
    evaluation batches keep their order and are dealt without repetition. `position()` (the
    batches already consumed this epoch when a run resumes) is skipped.
    """

    def __init__(
        self,
        batches: list[list[int]],
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        position: Callable[[], int] | None = None,
    ) -> None:
        self.batches, self.shuffle, self.seed = batches, shuffle, seed
        self.rank, self.world_size, self.position = rank, world_size, position
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def mine(self) -> list[list[int]]:
        order = list(range(len(self.batches)))
        if self.shuffle:
            rng = np.random.RandomState(self.seed + self.epoch)
            order = rng.permutation(len(self.batches)).tolist()
            per_rank = -(-len(order) // self.world_size)
            order += order[: per_rank * self.world_size - len(order)]
        return [self.batches[i] for i in order[self.rank :: self.world_size]]

    def __iter__(self) -> Iterator[list[int]]:
        skip = self.position() if self.position is not None else 0
        return iter(self.mine()[skip:])

    def __len__(self) -> int:
        return len(self.mine())


class TranslationCollator:
    """Pads a list of examples into a seq2seq batch.

    `inputs` (B, S) source ids (left-padded by default, as fairseq), `mask` True at real source
    ids, `targets` (B, T) target ids ending with `</s>` (right-padded), `target_mask`, and
    `index` (B,) the examples' positions in their split.
    """

    def __init__(self, pad_id: int = PAD_ID, left_pad_source: bool = True) -> None:
        self.pad_id, self.left_pad_source = pad_id, left_pad_source

    def _pad(self, seqs: list[Tensor], left: bool) -> tuple[Tensor, Tensor]:
        width = max(len(s) for s in seqs)
        out = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.bool)
        for i, s in enumerate(seqs):
            sl = slice(width - len(s), width) if left else slice(0, len(s))
            out[i, sl], mask[i, sl] = s, True
        return out, mask

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Tensor]:
        src, src_mask = self._pad([it["source"] for it in items], self.left_pad_source)
        tgt, tgt_mask = self._pad([it["target"] for it in items], False)
        index = torch.tensor([it["index"] for it in items], dtype=torch.long)
        return {"inputs": src, "mask": src_mask, "targets": tgt, "target_mask": tgt_mask,
                "index": index}  # fmt: skip
