"""The language-modelling task: metrics, carried state, exact resume, adaptive input/softmax."""

from __future__ import annotations

import functools
import math
import traceback
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

import megalab
from megalab.data.lm.stream import EvalBatches, Layout, LMStreamDataModule, TokenStream
from megalab.models.base import Backbone, BackboneOutput
from megalab.models.mega.model import MegaConfig
from megalab.models.transformer.model import TransformerConfig
from megalab.nn.adaptive import AdaptiveInput, AdaptiveSoftmax
from megalab.nn.embedding import SequenceEncoder
from megalab.nn.state import UnsafeStateError, pack_state, unpack_state
from megalab.tasks.base import NonFiniteLossError
from megalab.tasks.language_modeling import LanguageModelingTask, LinearLMHead


class Recurrent(Backbone):
    """A tiny causal recurrence h_t = a h_{t-1} + x_t that records the states it receives.

    A state starts at `initial_state`; the `received` log holds None for a stateless pass.
    """

    causal = True

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d_model = d
        self.logit = nn.Parameter(torch.zeros(d))
        self.out = nn.Linear(d, d)
        self.received: list[Tensor | None] = []
        self.fresh: list[bool] = []

    def initial_state(self, batch_size: int, like: Tensor) -> Tensor:
        return like.new_zeros(batch_size, self.d_model)

    def forward(self, x: Tensor, mask: Tensor | None = None, state: Tensor | None = None):
        fresh = state is not None and not state.any()
        self.received.append(None if state is None or fresh else state.clone())
        a = torch.sigmoid(self.logit)
        h = x.new_zeros(x.shape[0], x.shape[2]) if state is None else state
        outs = []
        for t in range(x.shape[1]):
            h = a * h + x[:, t]
            outs.append(h)
        return BackboneOutput(self.out(torch.stack(outs, 1)), None if state is None else h)


class FixedHead(nn.Module):
    """A head whose per-token NLL is given (to check the metric arithmetic by hand)."""

    def __init__(self, values: Tensor) -> None:
        super().__init__()
        self.values = values

    def nll(self, hidden: Tensor, targets: Tensor) -> Tensor:
        return self.values + 0.0 * hidden.sum()


def make_task(backbone: nn.Module | None = None, head: nn.Module | None = None, **kwargs):
    encoder = SequenceEncoder(4, vocab_size=11)
    head = head or LinearLMHead(4, 11)
    optim = {"optimizer": functools.partial(torch.optim.SGD, lr=0.5), "param_groups": []}
    return LanguageModelingTask(encoder, backbone or Recurrent(4), head, optim=optim, **kwargs)


def test_the_loss_sums_stay_float64_when_the_task_is_cast_to_16_bits() -> None:
    """`trainer.precision=bf16-true` casts the module with `.to(torch.bfloat16)`; the NLL and
    token sums behind the loss and perplexity stay float64 (1e6 + 1 is 999,424 in bfloat16)."""
    task = make_task().to(torch.bfloat16)
    assert {m.sum_value.dtype for m in task.sums.values()} == {torch.float64}
    nll = task.sums["val_nll"]
    nll(torch.tensor(1e6, dtype=torch.float64))
    nll(torch.tensor(1.0, dtype=torch.float64))
    assert nll.compute().item() == 1_000_001.0


def batch(inputs, reset=False, group=0, **extra) -> dict[str, Tensor]:
    inputs = torch.as_tensor(inputs)
    out = {
        "inputs": inputs,
        "targets": (inputs + 1) % 11,
        "reset": reset,
        "stream_group": group,
    }
    out.update(extra)
    return out


def test_word_level_perplexity_by_hand() -> None:
    nll = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    task = make_task(head=FixedHead(nll))
    task._step(
        batch(
            [[1, 2, 3, 4]],
            target_mask=torch.tensor([[True, True, True, False]]),
            num_words=torch.tensor(2),
        ),
        "val",
    )
    m = task.epoch_metrics("val")
    # 3 scored tokens, 6 nats, covering 2 words
    assert m["val/loss"].item() == pytest.approx(2.0)
    assert m["val/ppl"].item() == pytest.approx(math.exp(2.0))
    assert m["val/bpc"].item() == pytest.approx(2.0 / math.log(2.0))
    assert m["val/word_ppl"].item() == pytest.approx(math.exp(3.0))
    task._log_epoch = lambda split: None  # no trainer to log to
    for k in ("nll", "tokens", "words"):
        task.sums[f"val_{k}"].reset()
    task._step(batch([[1, 2]]), "val")
    assert "val/word_ppl" not in task.epoch_metrics("val"), "no word counts, no word_ppl"


def test_nan_at_unscored_positions_does_not_leak_but_nan_loss_fails() -> None:
    nll = torch.tensor([[1.0, float("nan")]])
    task = make_task(head=FixedHead(nll))
    loss = task._step(batch([[1, 2]], target_mask=torch.tensor([[True, False]])), "train")
    assert loss.item() == 1.0
    task._step(batch([[1, 2]]), "val")
    with pytest.raises(NonFiniteLossError, match="val loss is nan"):
        task.epoch_metrics("val")


def test_bidirectional_backbones_fail_early() -> None:
    with pytest.raises(ValueError, match=r"needs a causal backbone.*model.backbone.causal=true"):
        make_task(
            TransformerConfig(d_model=4, num_layers=1, num_heads=1, ffn_dim=8, causal=False).build()
        )
    with pytest.raises(ValueError, match="needs a causal backbone"):
        make_task(
            MegaConfig(d_model=4, num_layers=1, z_dim=4, v_dim=4, ffn_dim=4, causal=False).build()
        )
    make_task(
        TransformerConfig(d_model=4, num_layers=1, num_heads=1, ffn_dim=8, causal=True).build()
    )


def test_segment_longer_than_the_model_fails_loudly() -> None:
    backbone = TransformerConfig(d_model=4, num_layers=1, num_heads=1, ffn_dim=8, causal=True,
                                 positions="learned", max_len=8).build()  # fmt: skip
    with pytest.raises(ValueError, match=r"exceeds the model's limit of 8.*data.max_len"):
        make_task(backbone)._step(batch(torch.zeros(1, 16, dtype=torch.long)), "val")


def test_state_is_carried_per_group_and_reset() -> None:
    backbone = Recurrent(4)
    task = make_task(backbone, carry_state=True)
    x = [[1, 2, 3]]
    task._step(batch(x, reset=True, group=0), "train")
    s0 = task._state["train"][0]
    task._step(batch(x, reset=True, group=1), "train")
    task._step(batch(x, group=0), "train")
    task._step(batch(x, group=1), "train")
    task._step(batch(x, reset=True, group=0), "train")
    got = backbone.received
    assert got[0] is None and got[1] is None and got[4] is None
    assert torch.equal(got[2], s0) and not s0.requires_grad, "detached training state"
    assert torch.equal(got[3], got[2]), "both groups saw the same inputs"
    # evaluation keeps its own states
    task._step(batch(x, reset=True), "val")
    task._step(batch(x), "val")
    assert got[-1] is not None and 0 in task._state["train"]
    stateless = make_task(Recurrent(4), carry_state=False)
    stateless._step(batch(x, reset=True), "train")
    stateless._step(batch(x), "train")
    assert stateless.backbone.received == [None, None]


def test_streamed_evaluation_equals_one_pass_for_mega() -> None:
    torch.manual_seed(0)
    mega = MegaConfig(d_model=8, num_layers=2, z_dim=4, v_dim=8, ffn_dim=8, chunk_size=4,
                      rel_pos_bias="rotary", prenorm=True, final_norm_affine=False,
                      causal=True).build()  # fmt: skip
    encoder, head = SequenceEncoder(8, vocab_size=11), LinearLMHead(8, 11)
    stream = TokenStream(np.random.default_rng(0).integers(0, 11, 83), name="val")

    def evaluate(seq_len: int, carry: bool) -> float:
        task = LanguageModelingTask(encoder, mega, head, carry_state=carry).double().eval()
        ds = EvalBatches(stream, rows=2, seq_len=seq_len, layout=Layout())
        with torch.no_grad():
            for t in range(len(ds)):
                task._step(ds[(0, t)], "val")
        return task.epoch_metrics("val")["val/loss"].item()

    one_pass = evaluate(41, carry=False)  # each of the 2 rows (41 tokens) at once
    # segments of 8 with the carried state give the same result (logits are float32)
    assert evaluate(8, carry=True) == pytest.approx(one_pass, rel=1e-6)
    assert abs(evaluate(8, carry=False) - one_pass) > 1e-3, "without the state it differs"


def test_carried_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    mega = MegaConfig(d_model=8, num_layers=2, z_dim=4, v_dim=8, ffn_dim=8, chunk_size=4,
                      rel_pos_bias="rotary", causal=True).build()  # fmt: skip
    x = torch.randn(2, 6, 8)
    state = mega(x, state=mega.initial_state(2, x)).state
    torch.save({"s": pack_state({0: state, 1: (torch.ones(2), None)})}, tmp_path / "c.pt")
    back = unpack_state(torch.load(tmp_path / "c.pt", weights_only=True)["s"])
    assert type(back[0]) is type(state) and back[1][1] is None
    for a, b in zip(state.layers, back[0].layers):
        assert torch.equal(a.ema, b.ema) and torch.equal(a.kv.key, b.kv.key)


def test_a_crafted_carried_state_cannot_call_anything(tmp_path: Path) -> None:
    """Saved states name their class; only megalab's registered state classes are rebuilt."""
    marker = tmp_path / "pwned"
    for name in ("torch:os.system", "megalab.models.mega:Mega", "builtins:eval"):
        crafted = {"kind": "object", "class": name, "fields": {"command": f"touch {marker}"}}
        torch.save({"s": crafted}, tmp_path / "c.pt")
        with pytest.raises(UnsafeStateError, match="refusing to rebuild"):
            unpack_state(torch.load(tmp_path / "c.pt", weights_only=True)["s"])
    assert not marker.exists()


class RandomTokens(LMStreamDataModule):
    def __init__(self, **kwargs) -> None:
        super().__init__("unused", max_len=5, batch_size=2, vocab_size=11, **kwargs)

    def load_streams(self) -> dict[str, TokenStream]:
        rng = np.random.default_rng(0)
        return {
            s: TokenStream(rng.integers(0, 11, n), name=s)
            for s, n in (("train", 301), ("val", 40), ("test", 40))
        }


def fit(tmp_path: Path, max_steps: int, resume: bool) -> LanguageModelingTask:
    torch.manual_seed(0)
    task = make_task(Recurrent(4), carry_state=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        deterministic=True,
        callbacks=[ModelCheckpoint(tmp_path, save_last=True, every_n_train_steps=1, save_top_k=0)],
    )
    trainer.fit(task, datamodule=RandomTokens(), ckpt_path="last" if resume else None)
    return task


def test_resume_mid_epoch_continues_exactly_with_the_carried_state(tmp_path: Path) -> None:
    straight = fit(tmp_path / "a", 9, resume=False)
    fit(tmp_path / "b", 4, resume=False)
    resumed = fit(tmp_path / "b", 9, resume=True)
    # the resumed run received exactly the states of steps 5..9 of the straight run
    for a, b in zip(straight.backbone.received[4:], resumed.backbone.received):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert len(resumed.backbone.received) == 5 and resumed.backbone.received[0] is not None
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


# ----------------------------------------------------------------- adaptive input / softmax


def adaptive_pair(vocab=50, d=16, cutoffs=(10, 30), factor=2, tie_proj=True):
    inp = AdaptiveInput(vocab, d, cutoffs, factor)
    out = AdaptiveSoftmax(d, vocab, cutoffs, factor, tie_proj=tie_proj)
    return inp, out


def test_adaptive_softmax_is_a_distribution_and_nll_matches_it() -> None:
    torch.manual_seed(0)
    _, out = adaptive_pair()
    h = torch.randn(3, 5, 16)
    logp = out.log_probs(h)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(3, 5))
    t = torch.tensor([[0, 9, 10, 29, 30], [49, 3, 15, 35, 1], [11, 12, 13, 40, 45]])
    torch.testing.assert_close(out.nll(h, t), -logp.gather(-1, t.unsqueeze(-1)).squeeze(-1))
    with pytest.raises(ValueError, match="target id 50 is outside the vocabulary of 50"):
        out.nll(h[:, :1], torch.full((3, 1), 50))


def test_weight_tying_goes_through_the_heads_declared_tie_encoder() -> None:
    """`tie_weights` asks the head (`LMHead.tie_encoder`): a linear head ties to the token table
    of a token encoder; a head or an encoder that cannot tie is refused with what to change."""
    from megalab.nn.embedding import FeatureEmbedding, TokenEmbedding
    from megalab.nn.lm_head import LMHead

    tokens = SequenceEncoder(vocab_size=50, d_model=16)
    head = LinearLMHead(16, 50)
    LanguageModelingTask(tokens, Recurrent(16), head, tie_weights=True)
    assert isinstance(tokens.embed, TokenEmbedding)
    assert head.proj.weight is tokens.embed.embedding.weight
    bare = TokenEmbedding(50, 16)
    LinearLMHead(16, 50).tie_encoder(bare)
    with pytest.raises(ValueError, match="needs a token embedding in the encoder, got Feature"):
        LinearLMHead(16, 50).tie_encoder(FeatureEmbedding(3, 16))

    class Plain(nn.Module):
        def nll(self, hidden: Tensor, targets: Tensor) -> Tensor:
            return hidden.sum(-1)

    with pytest.raises(
        TypeError, match=r"needs an LM head \(megalab.nn.lm_head.LMHead\), got Plain"
    ):
        LanguageModelingTask(tokens, Recurrent(16), Plain(), tie_weights=True)
    LanguageModelingTask(tokens, Recurrent(16), Plain())  # untied: any head with nll

    class Untieable(LMHead):
        pass

    with pytest.raises(ValueError, match=r"Untieable cannot share its weights.*tie_weights=false"):
        LanguageModelingTask(tokens, Recurrent(16), Untieable(), tie_weights=True)


def test_adaptive_input_bands_and_scale() -> None:
    inp = AdaptiveInput(50, 16, [10, 30], factor=2, scale=True)
    assert [e.weight.shape for e in inp.embeddings] == [(10, 16), (20, 8), (20, 4)]
    tokens = torch.tensor([[0, 12, 45]])
    x = inp(tokens, torch.tensor([[True, True, False]]))
    e, p = inp.band_weights(1)
    torch.testing.assert_close(x[0, 1], (e[2] @ p.t()) * 4.0)
    assert torch.equal(x[0, 2], torch.zeros(16))
    with pytest.raises(ValueError, match="token id 50"):
        inp(torch.tensor([[50]]))


def test_tied_weights_and_projections_are_shared() -> None:
    inp, out = adaptive_pair()
    task = LanguageModelingTask(inp, Recurrent(16), out, tie_weights=True)
    assert out.head_words is inp.embeddings[0].weight
    for i, tail in enumerate(out.tails):
        assert tail.out is inp.embeddings[i + 1].weight
        assert tail.proj is inp.projections[i + 1].weight and tail.proj_transposed
    n_params = sum(p.numel() for p in task.parameters())
    assert n_params == sum(p.numel() for p in inp.parameters()) + 2 * 16 + sum(
        p.numel() for p in task.backbone.parameters()
    )
    with pytest.raises(ValueError, match="ties only to an AdaptiveInput"):
        AdaptiveSoftmax(16, 50, [10, 30], 2).tie(nn.Embedding(50, 16))


def test_mega_wikitext103_adaptive_parameters_match_the_paper() -> None:
    """Adaptive input + tied softmax of Mega's WT103 model (vocab 267,744, the fairseq
    dictionary, as in docs/reference/mega-paper.md §7): embeddings 45.39M of the 252.2M."""
    with torch.device("meta"):
        inp = AdaptiveInput(267_744, 1024, [20000, 60000], 4, scale=True)
        out = AdaptiveSoftmax(1024, 267_744, [20000, 60000], 4, dropout=0.2, tie_proj=True)
    out.tie(inp)
    unique = {id(p): p.numel() for m in (inp, out) for p in m.parameters()}
    band = [20000 * 1024 + 1024 * 1024, 40000 * 256 + 256 * 1024, 207744 * 64 + 64 * 1024]
    assert sum(unique.values()) == sum(band) + 2 * 1024  # + the 2 cluster logits of the head


def test_mega_wikitext103_experiment_has_252m_parameters(compose_cfg) -> None:
    """The experiment config gives the paper's 252M (Table 5): one layer built, 16 counted."""
    import hydra

    cfg = compose_cfg("experiment=mega/wikitext103", "model.backbone.num_layers=1")
    assert cfg.data.vocab_size == 267_735 and cfg.model.backbone.v_dim == 2048
    backbone = hydra.utils.instantiate(cfg.task.backbone).build()
    with torch.device("meta"):  # 45M embedding parameters: count them without allocating
        encoder = hydra.utils.instantiate(cfg.task.encoder)
        head = hydra.utils.instantiate(cfg.task.head)
    task = LanguageModelingTask(encoder, backbone, head, tie_weights=cfg.task.tie_weights)
    per_layer = sum(p.numel() for p in backbone.layers[0].parameters())
    total = sum(p.numel() for p in task.parameters()) + 15 * per_layer
    assert round(total / 1e6, 1) == 252.2, total


@pytest.mark.slow
def test_ddp_streams_and_carried_state_in_checkpoints(fixture_data_dir: Path, tmp_path: Path):
    """Two CPU processes: each takes its own rows, and the checkpoint holds both states."""
    from conftest import FAST, run_cli

    proc = run_cli(
        "-m",
        "megalab.cli.train",
        *FAST,
        "trainer=ddp_cpu",
        "data=enwik8",
        "model=mega",
        "task=language_modeling",
        f"paths.data_dir={fixture_data_dir}",
        f"hydra.run.dir={tmp_path}",
        "data.sha256=null",
        "data.valid_size=3000",
        "data.test_size=3000",
        "data.max_len=16",
        "data.batch_size=4",
        "data.eval_batch_size=4",
        "model.d_model=16",
        "model.backbone.num_layers=1",
        "model.backbone.z_dim=8",
        "model.backbone.v_dim=16",
        "model.backbone.ffn_dim=16",
        "model.backbone.causal=true",
        "model.backbone.chunk_size=8",
        "model.backbone.rel_pos_bias=rotary",
        "task.carry_state=true",
        "+callbacks.model_checkpoint.every_n_train_steps=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    ranks = ckpt["lm_train_state"]["ranks"]
    assert len(ranks) == 2 and all(r["items"] for r in ranks)
    states = [unpack_state(r["items"][0][1]) for r in ranks]
    assert not torch.equal(states[0].layers[0].ema, states[1].layers[0].ema), "own rows"


# Where a training step may read a value back from the device (a host sync on a GPU, which
# stalls the launch queue): the finite-loss check; for language models the scored-token count
# (the logged loss's weight); for the memory models the token and target id checks (an id out
# of range would be a device-side assert) and the memory's padding checks.
DEVICE_READS = {
    "llama/pg19": {"tasks/language_modeling.py": 1, "tasks/base.py": 1},
    "lamemo/enwik8": {
        "tasks/language_modeling.py": 1,
        "tasks/base.py": 1,
        "nn/adaptive.py": 2,
        "models/transformer_xl/memory.py": 2,
    },
    "mega/lra_listops": {"tasks/base.py": 1},  # classification: tokens/s stays on the device
    # and one per SeqBoat layer (6): the packed length L' = max_b Σ_t a_bt, a shape that depends
    # on the routing's decisions, as in the authors' code (it read twice before)
    "seqboat/lra_listops": {"tasks/base.py": 1, "models/seqboat/model.py": 6},
}
_READS = {
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.tolist,
    torch.Tensor.nonzero,
    torch.nonzero,
}


class _DeviceReads(torch.overrides.TorchFunctionMode):
    """Records the file of megalab's innermost frame at each read of a tensor's values."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        read = func in _READS
        if func is torch.Tensor.__getitem__:  # boolean-mask indexing sizes its output
            items = args[1] if isinstance(args[1], tuple) else (args[1],)
            read = any(isinstance(i, Tensor) and i.dtype == torch.bool for i in items)
        if read:
            package = Path(megalab.__file__).parent
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(str(package))]
            self.files.append(
                Path(frames[-1].filename).relative_to(package).as_posix() if frames else "?"
            )
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("experiment", list(DEVICE_READS))
def test_a_training_step_reads_the_device_only_where_it_must(
    compose_cfg, experiment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's stream metadata stays on the host, the id checks read once each: a GPU step
    waits for the device only at the places listed in `DEVICE_READS`."""
    import hydra

    from test_experiments import fixture_overrides

    cfg = compose_cfg(f"experiment={experiment}", *fixture_overrides(compose_cfg, experiment))
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    if "reset" in batch:
        assert isinstance(batch["reset"], bool) and isinstance(batch["stream_group"], int)
    task = hydra.utils.instantiate(cfg.task)
    # No Trainer: what is logged is Lightning's to read, at the end of the batch.
    monkeypatch.setattr(task, "log", lambda *args, **kwargs: None)
    monkeypatch.setattr(task, "log_throughput", lambda tokens: None)
    for _ in range(2):  # a fresh stream, then one continued with the carried state
        reads = _DeviceReads()
        with reads:
            task.training_step(batch, 0)
        counts = {f: reads.files.count(f) for f in set(reads.files)}
        assert counts == DEVICE_READS[experiment], counts
        if "reset" in batch:
            batch = {**batch, "reset": False}
