"""Chunk parallelism: 2 gloo ranks, each on half of every sequence and exchanging only the
carried state (forward) and its gradient (backward), give the loss and the gradients of 1 rank
on the whole sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from causal_models import build_lm
from megalab.parallel.chunk import flatten_state, unflatten_state
from parallel_worker import batch, loss_and_grads, run

CASES = [
    # Mega-chunk (c = 8): slices of 16 start on chunk boundaries, only EMA states cross.
    ("mega", "causal_softmax_rotary", 32),
    # Slices of 14: the keys/values of the chunk open at the boundary cross as well.
    ("mega", "causal_laplace_postnorm", 28),
    # Full attention (no chunks): the whole key/value prefix crosses.
    ("mega", "causal_relu2_full_scalenorm", 24),
    # Llama: its key/value cache is the state (grouped-query attention).
    ("llama", "causal_gqa_maxlen", 32),
    # Megalodon (c = 8): each block's CEMA state h (complex) and timestep-norm statistics, and
    # the final norm's statistics cross; slices of 16 start on chunk boundaries (as the
    # authors' chunk parallelism requires), slices of 14 also carry the open chunk's keys and
    # values, and full attention its whole key/value prefix.
    ("megalodon", "chunked_swiglu_two_heads", 32),
    ("megalodon", "chunked_swiglu_two_heads", 28),
    ("megalodon", "full_attention", 24),
]


def test_two_gloo_ranks_equal_one_rank_on_the_whole_sequence(tmp_path: Path) -> None:
    mp.spawn(run, args=(2, str(tmp_path / "init"), str(tmp_path), CASES), nprocs=2, join=True)
    for name, variant, length in CASES:
        got = torch.load(tmp_path / f"{name}-{variant}-{length}.pt", weights_only=True)
        task = build_lm(name, variant).train()
        inputs, targets = batch(length)
        loss, grads = loss_and_grads(task, inputs, targets, targets.numel())
        torch.testing.assert_close(got["loss"], loss, rtol=1e-10, atol=1e-12)
        assert set(got["grads"]) == set(grads)
        for n, g in grads.items():
            torch.testing.assert_close(got["grads"][n], g, rtol=1e-9, atol=1e-12, msg=n)


def test_state_headers_round_trip_without_pickling() -> None:
    task = build_lm("mega", "causal_softmax_rotary")
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    state = task.backbone(x, None, task.backbone.initial_state(2, x)).state
    header, tensors = flatten_state(state)
    assert "MegaState" in header and len(tensors) == 2 * 3  # EMA state, keys, values per layer
    back = unflatten_state(header, tensors)
    assert type(back) is type(state)
    torch.testing.assert_close(back.layers[1].kv.key, state.layers[1].kv.key)
    with pytest.raises(ValueError, match="refusing to rebuild a saved state of class"):
        unflatten_state(header.replace("MegaState", "Evil"), tensors)


# The exchange itself is tested in the default suite (two gloo ranks = one rank); this 16 s
# end-to-end run through trainer=chunk_parallel_cpu is slow.
@pytest.mark.slow
def test_trainer_option_trains_like_one_process(fixture_data_dir: Path, tmp_path: Path) -> None:
    """`trainer=chunk_parallel_cpu` (2 gloo processes, one group) trains Mega-chunk on the
    halves of each window and logs the losses of a single process on the whole windows."""
    import json

    from conftest import FAST, run_cli

    def read_metrics(run_dir: Path) -> dict:
        return json.loads((run_dir / "metrics.json").read_text())

    common = [
        *FAST,
        "data=enwik8", "data.sha256=null", "data.valid_size=3000", "data.test_size=3000",
        "data.sampler=random", "data.max_len=32", "data.batch_size=4", "data.eval_batch_size=2",
        "data.eval_max_len=30", "model=mega", "task=language_modeling", "task.carry_state=false",
        "model.d_model=16", "model.backbone.num_layers=2", "model.backbone.z_dim=8",
        "model.backbone.v_dim=16", "model.backbone.ffn_dim=16", "model.backbone.causal=true",
        "model.backbone.prenorm=true", "model.backbone.chunk_size=8",
        "model.backbone.rel_pos_bias=rotary", "model.backbone.dropout=0.0",
        "model.encoder.dropout=0.0", "trainer.max_steps=2", "trainer.limit_val_batches=2",
        f"paths.data_dir={fixture_data_dir}",
    ]  # fmt: skip
    records = {}
    for trainer in ("cpu", "chunk_parallel_cpu"):
        out = tmp_path / trainer
        proc = run_cli("-m", "megalab.cli.train", *common, f"trainer={trainer}",
                       f"hydra.run.dir={out}")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[trainer] = read_metrics(out)
    one, two = records["cpu"], records["chunk_parallel_cpu"]
    assert two["global_step"] == 2
    for key in ("train/loss_step", "val/loss", "test/loss"):
        assert abs(one["metrics"][key] - two["metrics"][key]) < 1e-4, key


# Megalodon and Llama through `trainer=chunk_parallel_cpu` as users launch them, shrunk to 2
# layers of width 64 so that a 2-process run takes seconds of compute (fixture data as
# tests/test_experiments.py; dropout off so that 2 processes and 1 draw nothing at random).
_PG19 = ["data.max_len=64", "data.eval_max_len=64", "data.train_len_unit=10",
         "data.vocab_size=400", "data.tokenizer_sample_books=null"]  # fmt: skip
_MEGALODON_SMALL = ["model.d_model=64", "model.backbone.num_layers=2", "model.backbone.z_dim=16",
                    "model.backbone.v_dim=128", "model.backbone.ffn_dim=96",
                    "model.backbone.norm_groups=2", "model.backbone.chunk_size=16"]  # fmt: skip
TRAINER_CASES = {
    # The ~100M comparison config (plain embedding, stateless windows); 4 chunks of 16 per
    # 64-token window, 2 per rank.
    "megalodon/pg19_100m": [*_PG19, *_MEGALODON_SMALL],
    # WikiText-103: adaptive input and softmax (bands without a token in a rank's slice leave
    # parameters unused there) and evaluation streams that carry their state (run whole on
    # every rank), random windows of 20 to 60 tokens for training.
    "megalodon/wikitext103": [
        "data.max_len=64",
        "data.eval_max_len=64",
        "data.train_len_unit=10",
        "data.vocab_size=61056",
        *_MEGALODON_SMALL,
        "model.backbone.dropout=0.0",
        "model.backbone.attention_dropout=0.0",
        "model.backbone.hidden_dropout=0.0",
        "model.adaptive_input.dropout=0.0",
        "task.head.dropout=0.0",
    ],
    "llama/pg19": [
        *_PG19,
        "model.d_model=64",
        "model.backbone.num_layers=2",
        "model.backbone.num_heads=4",
        "model.backbone.ffn_dim=192",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("experiment", sorted(TRAINER_CASES))
def test_experiment_trains_chunk_parallel_like_one_process(
    experiment: str, fixture_data_dir: Path, tmp_path: Path
) -> None:
    """`python -m megalab.cli.train experiment=<...> trainer=chunk_parallel_cpu` trains 2 steps
    with the losses of `trainer=cpu` (about 20 s per run: two processes start)."""
    import json
    import math

    from conftest import FAST, run_cli

    metrics = {}
    for trainer in ("cpu", "chunk_parallel_cpu"):
        out = tmp_path / trainer
        proc = run_cli("-m", "megalab.cli.train", *FAST, f"experiment={experiment}",
                       *TRAINER_CASES[experiment], f"trainer={trainer}",
                       f"paths.data_dir={fixture_data_dir}", f"hydra.run.dir={out}")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        record = json.loads((out / "metrics.json").read_text())
        assert record["global_step"] == 2
        metrics[trainer] = record["metrics"]
    for key in ("train/loss_step", "train/loss_epoch", "val/loss", "test/loss"):
        one, two = metrics["cpu"][key], metrics["chunk_parallel_cpu"][key]
        assert math.isfinite(two) and abs(one - two) < 1e-4, (key, one, two)


def _build(compose_cfg, *overrides: str):
    from megalab.cli.train import build

    cfg = compose_cfg(*overrides, "trainer=chunk_parallel_cpu", "logger=none")
    return build(cfg)


def test_streams_carried_across_training_batches_fail_before_processes_start(
    compose_cfg,
) -> None:
    """Megalodon on PG-19 carries its state from one training segment to the next: chunk
    parallelism cannot (the last slice's state would start the next batch's first slice), and
    says so while building the run, before any process starts."""
    with pytest.raises(ValueError, match="carries the state from one training batch") as err:
        _build(compose_cfg, "experiment=megalodon/pg19", *_PG19, *_MEGALODON_SMALL)
    assert "data.sampler=random" in str(err.value) and "trainer=ddp" in str(err.value)
    with pytest.raises(TypeError, match=r"not one \(use task=language_modeling"):
        _build(compose_cfg, "experiment=megalodon/lra_listops", "model.d_model=16",
               "model.backbone.num_layers=1")  # fmt: skip


def test_adaptive_bands_make_ddp_look_for_unused_parameters(compose_cfg) -> None:
    """With adaptive input/softmax bands the strategy turns DDP's unused-parameter search on
    (a band without a token in a rank's slice is unused there); without them it stays off."""
    objs = _build(compose_cfg, "experiment=megalodon/wikitext103",
                  *TRAINER_CASES["megalodon/wikitext103"])  # fmt: skip
    assert objs["trainer"].strategy._ddp_kwargs["find_unused_parameters"] is True
    objs = _build(
        compose_cfg, "experiment=megalodon/pg19_100m", *TRAINER_CASES["megalodon/pg19_100m"]
    )
    assert objs["trainer"].strategy._ddp_kwargs["find_unused_parameters"] is False


def test_a_new_exchange_replaces_the_hooks_of_the_previous_one() -> None:
    """Lightning sets the strategy up again for every fit/validate/test: the task keeps the
    hooks of the newest exchange only (two sets would exchange every state twice, and a paused
    exchange would leave the other one running)."""

    class Exchange:
        def __init__(self) -> None:
            self.calls = 0

        def install(self, backbone: torch.nn.Module) -> list:
            def hook(module, args, output) -> None:
                self.calls += 1

            return [backbone.register_forward_hook(hook)]

    task = build_lm("megalodon", "chunked_swiglu_two_heads")
    first, second = Exchange(), Exchange()
    task.use_chunk_parallel(first)
    task.use_chunk_parallel(second)
    x = torch.randn(1, 8, task.backbone.d_model, dtype=torch.float64)
    task.backbone(x)
    assert (first.calls, second.calls) == (0, 1) and task.chunk_parallel is second


def test_a_backbone_without_the_hook_is_refused_when_the_run_is_built() -> None:
    from megalab.parallel.lightning import ChunkParallelStrategy

    task = build_lm("transformer_xl", "long_memory")
    with pytest.raises(TypeError, match="TransformerXL cannot run chunk-parallel"):
        ChunkParallelStrategy(chunk_parallel_size=2).check(task)
    ChunkParallelStrategy(chunk_parallel_size=2).check(build_lm("llama", "causal_gqa_maxlen"))


def test_plain_ddp_also_looks_for_unused_adaptive_bands(compose_cfg) -> None:
    """Data parallelism has the same hazard (a rank's batch without a token of some band): the
    run turns the search on for models with adaptive bands and leaves it off for the rest."""
    from megalab.cli.train import build

    def ddp(*overrides: str):
        return build(compose_cfg(*overrides, "trainer=ddp_cpu", "logger=none"))["trainer"]

    trainer = ddp("experiment=megalodon/wikitext103", *TRAINER_CASES["megalodon/wikitext103"])
    assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is True
    trainer = ddp("experiment=megalodon/pg19_100m", *TRAINER_CASES["megalodon/pg19_100m"])
    assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is False


def test_a_backbone_with_data_dependent_parameters_makes_ddp_look_for_unused_ones() -> None:
    """LaMemo's v₋ serves the look-ahead attention over a carried memory only, which the first
    segment of a stream has not: the backbone declares `data_dependent_parameters` and DDP
    looks for unused parameters; Transformer-XL uses every parameter in every pass."""
    from lightning.pytorch.strategies import DDPStrategy

    from megalab.parallel.lightning import find_unused_data_dependent_parameters

    for name, variant, search in [("lamemo", "look_ahead", True),
                                  ("lamemo", "xl_rpe_no_interpolation_short_memory", False),
                                  ("transformer_xl", "long_memory", False)]:  # fmt: skip
        strategy = DDPStrategy(find_unused_parameters=False)
        find_unused_data_dependent_parameters(strategy, build_lm(name, variant))
        assert strategy._ddp_kwargs["find_unused_parameters"] is search, (name, variant)


def test_transformer_xl_adaptive_bands_also_make_ddp_look_for_unused_parameters() -> None:
    """Transformer-XL's adaptive embedding and softmax (`megalab.nn.adaptive_xl`) are
    `BandedParameters` as megalab's own adaptive layers are; a plain embedding is not."""
    from lightning.pytorch.strategies import DDPStrategy

    from megalab.nn.adaptive_xl import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
    from megalab.parallel.lightning import find_unused_data_dependent_parameters

    for module, search in [
        (AdaptiveEmbedding(64, 16, cutoffs=(8, 32), div_val=2), True),
        (ProjectedAdaptiveLogSoftmax(16, 64, cutoffs=(8, 32), div_val=2), True),
        (torch.nn.Embedding(64, 16), False),
    ]:
        strategy = DDPStrategy(find_unused_parameters=False)
        find_unused_data_dependent_parameters(strategy, torch.nn.ModuleDict({"part": module}))
        assert strategy._ddp_kwargs["find_unused_parameters"] is search, type(module).__name__
