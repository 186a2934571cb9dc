"""Classification and retrieval tasks: pooling, heads, losses and loud failures."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from torch import nn

from megalab.models.base import BackboneOutput
from megalab.models.transformer.model import TransformerConfig
from megalab.nn.embedding import FeatureEmbedding, SequenceEncoder, init_bert_params
from megalab.nn.heads import ClassificationHead, masked_mean, pool
from megalab.tasks import ClassificationTask, RetrievalTask
from megalab.tasks.base import NonFiniteLossError, SequenceTask


def test_pooling_modes_respect_lengths() -> None:
    y = torch.arange(2 * 4 * 1, dtype=torch.float32).view(2, 4, 1)
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    assert pool(y, mask, "mean").flatten().tolist() == [1.5, 4.5]
    assert pool(y, mask, "sum").flatten().tolist() == [6.0, 9.0]
    assert pool(y, mask, "first").flatten().tolist() == [0.0, 4.0]
    assert pool(y, mask, "last").flatten().tolist() == [3.0, 5.0]
    torch.testing.assert_close(masked_mean(y, None), y.mean(1))
    with pytest.raises(ValueError, match="unknown pooling mode"):
        pool(y, mask, "max")


def test_classification_head_is_the_authors_classifier() -> None:
    head = ClassificationHead(8, 16, 3, dropout=0.0)
    assert head.fc1.weight.shape == (16, 8) and head.fc2.bias is None
    x = torch.randn(4, 8)
    expected = head.fc2(torch.nn.functional.gelu(head.fc1(x)))
    torch.testing.assert_close(head(x), expected)
    assert ClassificationHead(8, 0, 3).fc2.bias is not None
    with pytest.raises(ValueError, match="num_classes"):
        ClassificationHead(8, 16, 1)
    torch.manual_seed(0)
    bert = ClassificationHead(512, 1024, 10, init="bert")
    assert abs(bert.fc1.weight.std().item() - 0.02) < 1e-3 and (bert.fc1.bias == 0).all()
    with pytest.raises(ValueError, match="unknown head init"):
        ClassificationHead(8, 16, 3, init="kaiming")


def _parts(vocab: int = 12, d: int = 8):
    encoder = SequenceEncoder(d, vocab_size=vocab, pad_id=0)
    backbone = TransformerConfig(
        d_model=d, num_layers=1, num_heads=2, ffn_dim=16, dropout=0.0
    ).build()
    head = functools.partial(ClassificationHead, d_hidden=16, num_classes=3)
    return encoder, backbone, head


def test_classification_task_builds_its_head_from_the_backbone_width() -> None:
    task = ClassificationTask(*_parts(), num_classes=3)
    assert task.head.fc1.in_features == 8
    tokens = torch.randint(1, 12, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    logits = task(tokens, mask)
    assert logits.shape == (2, 3)
    # padded positions (any token) do not change the prediction
    tokens2 = tokens.clone()
    tokens2[1, 4:] = 7
    torch.testing.assert_close(task(tokens2, mask), logits)


def test_evaluation_loss_is_the_mean_over_examples_not_over_batches() -> None:
    """val/test loss over batches of 5 and 2 examples (a last, smaller batch) is the mean of
    the 7 examples' losses. torchmetrics' MeanMetric(nan_strategy="disable") drops the weight
    it is given, which made it the mean of the two batch means."""
    torch.manual_seed(0)
    task = ClassificationTask(*_parts(), num_classes=3).eval()
    batches = [
        {"inputs": torch.randint(1, 12, (n, 6)), "targets": torch.randint(0, 3, (n,))}
        for n in (5, 2)
    ]
    with torch.no_grad():
        for batch in batches:
            task._step(batch, "test")
        logits = torch.cat([task(b["inputs"]) for b in batches])
    targets = torch.cat([b["targets"] for b in batches])
    expected = torch.nn.functional.cross_entropy(logits, targets)
    torch.testing.assert_close(task.losses["test_loss"].compute(), expected)


def test_metric_states_keep_their_dtype_when_the_task_is_cast_to_16_bits() -> None:
    """`trainer.precision=bf16-true` casts the module with `.to(torch.bfloat16)`. The loss's
    sum and example count stay float32: in bfloat16 the count stops at 256 (256 + 1 == 256)."""
    torch.manual_seed(0)
    task = ClassificationTask(*_parts(), num_classes=3).eval().to(torch.bfloat16)
    loss = task.losses["test_loss"]
    assert loss.mean_value.dtype == torch.float32 and loss.weight.dtype == torch.float32
    assert next(task.encoder.parameters()).dtype == torch.bfloat16  # the model is cast
    losses = []
    with torch.no_grad():
        for _ in range(300):
            batch = {"inputs": torch.randint(1, 12, (1, 6)), "targets": torch.randint(0, 3, (1,))}
            logits = task(batch["inputs"])
            losses.append(torch.nn.functional.cross_entropy(logits.float(), batch["targets"]))
            task._step(batch, "test")
    assert loss.weight.item() == 300
    torch.testing.assert_close(loss.compute(), torch.stack(losses).mean())


class _RankAux(L.LightningModule):
    """Logs its rank as a backbone's aux value through `SequenceTask.aux_loss`, one example each."""

    aux_loss = SequenceTask.aux_loss

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def step(self, split: str) -> None:
        rank = torch.tensor([float(self.global_rank)] * 2)  # per layer: two layers
        self.aux_loss(BackboneOutput(self.w.expand(1, 1, 1), None, {"share": rank}), split, 1)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.step("test")

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.zeros(1, 1), batch_size=1)


def test_evaluation_aux_values_are_averaged_over_ddp_processes() -> None:
    """A backbone's aux values in a test (SeqBoat's activation share, its attention span) are
    the mean over both processes' batches, not rank zero's alone."""
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    (results,) = trainer.test(_RankAux())
    assert results == {
        "test/aux/share": 0.5, "test/aux/share/layer0": 0.5, "test/aux/share/layer1": 0.5
    }  # fmt: skip


def test_retrieval_task_combines_two_documents() -> None:
    for combine, width in (("concat", 16), ("nli", 32)):
        task = RetrievalTask(*_parts(), num_classes=3, combine=combine)
        assert task.head.fc1.in_features == width
        a, b = torch.randint(1, 12, (2, 5)), torch.randint(1, 12, (2, 7))
        ma, mb = torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 7, dtype=torch.bool)
        logits = task(a, ma, b, mb)
        fa, fb = task.features(a, ma), task.features(b, mb)
        pair = (
            torch.cat([fa, fb], -1)
            if combine == "concat"
            else torch.cat([fa, fb, fa - fb, fa * fb], -1)
        )
        torch.testing.assert_close(logits, task.head(pair))
    with pytest.raises(ValueError, match="unknown pair combination"):
        RetrievalTask(*_parts(), num_classes=3, combine="dot")


def test_soft_targets_and_label_smoothing() -> None:
    task = ClassificationTask(*_parts(), num_classes=3, label_smoothing=0.1)
    batch = {
        "inputs": torch.randint(1, 12, (4, 5)),
        "mask": torch.ones(4, 5, dtype=torch.bool),
        "targets": torch.tensor([0, 1, 2, 1]),
    }
    hard = task._step(batch, "val")
    smooth = task._step(batch, "train")
    assert not torch.isclose(hard, smooth)  # smoothing applies to training only
    soft = dict(batch, targets=torch.nn.functional.one_hot(batch["targets"], 3).float())
    torch.testing.assert_close(task._step(soft, "val"), hard)


def test_nan_loss_fails_loudly() -> None:
    task = ClassificationTask(*_parts(), num_classes=3)
    with pytest.raises(NonFiniteLossError, match="lower the learning rate"):
        task.assert_finite(torch.tensor(float("nan")))


def test_too_long_input_fails_before_the_model() -> None:
    encoder, _, head = _parts()
    backbone = TransformerConfig(
        d_model=8, num_layers=1, num_heads=2, ffn_dim=16, positions="learned", max_len=4
    ).build()
    task = ClassificationTask(encoder, backbone, head, num_classes=3)
    with pytest.raises(ValueError, match="exceeds the model's limit of 4"):
        task(torch.randint(1, 12, (1, 6)), None)


def test_encoder_checks_input_kind() -> None:
    with pytest.raises(ValueError, match="exactly one of vocab_size"):
        SequenceEncoder(8)
    enc = SequenceEncoder(8, d_input=1, feature_init="mega")
    assert enc(torch.randn(2, 5)).shape == (2, 5, 8)
    with pytest.raises(TypeError, match="TokenEmbedding"):
        enc(torch.randint(0, 3, (2, 5)))
    tok = SequenceEncoder(8, vocab_size=5, pad_id=0)
    with pytest.raises(TypeError, match="FeatureEmbedding"):
        tok(torch.randn(2, 5))
    assert isinstance(tok.embed.embedding, nn.Embedding)


def test_encoder_bert_init_draws_the_token_table_with_a_zero_padding_row() -> None:
    torch.manual_seed(0)
    enc = SequenceEncoder(64, vocab_size=300, pad_id=1, init="bert")
    table = enc.embed.embedding.weight
    assert (table[1] == 0).all()
    rest = torch.cat([table[:1], table[2:]])
    assert rest.std().item() == pytest.approx(0.02, rel=0.05) and abs(rest.mean().item()) < 0.002
    # the default is the authors' N(0, d^-1/2) table
    default = SequenceEncoder(64, vocab_size=300, pad_id=1).embed.embedding.weight
    assert default.std().item() == pytest.approx(64**-0.5, rel=0.05)
    # real-valued inputs keep `feature_init` (fairseq's init_bert_params skips RealNumberEmbedding)
    torch.manual_seed(0)
    feat = SequenceEncoder(64, d_input=1, feature_init="mega", init="bert").embed.proj
    torch.manual_seed(0)
    ref = SequenceEncoder(64, d_input=1, feature_init="mega").embed.proj
    torch.testing.assert_close(feat.weight, ref.weight)
    torch.testing.assert_close(feat.bias, ref.bias)
    with pytest.raises(ValueError, match="init must be one of"):
        SequenceEncoder(8, vocab_size=5, init="xavier")
    with pytest.raises(ValueError, match="leave init_std unset"):
        SequenceEncoder(8, vocab_size=5, token_init_std=0.1, init="bert")


def test_init_bert_params_touches_only_linears_and_embeddings() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(50, 400), nn.LayerNorm(400), nn.Embedding(40, 400, 3))
    with torch.no_grad():
        net[1].weight.fill_(2.0)
    net.apply(init_bert_params)
    assert net[0].weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert (net[0].bias == 0).all()
    assert (net[1].weight == 2.0).all()  # norms are left alone
    assert (net[2].weight[3] == 0).all()
    assert net[2].weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_feature_scale_multiplies_the_pixel_embedding_by_sqrt_d() -> None:
    x = torch.randn(2, 7)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    torch.manual_seed(0)
    plain = SequenceEncoder(16, d_input=1, feature_init="mega")
    torch.manual_seed(0)
    scaled = SequenceEncoder(16, d_input=1, feature_init="mega", feature_scale=True)
    torch.testing.assert_close(scaled(x, mask), 4.0 * plain(x, mask))
    assert (scaled(x, mask)[1, 5:] == 0).all()
    assert FeatureEmbedding(1, 16).embed_scale == 1.0  # off by default


# What each fairseq LRA Transformer arch sets (docs/reference/mega-code.md §2.2 and the arch code):
# apply_bert_init, sentence representation ('cls' reads a prepended <CLS>) and, for pixel
# inputs, the sqrt(D) embedding scale; every one of them has `encoder_normalize_before`.
LRA_ARCHS = {
    "lra_listops": ("bert", "first", True, False),
    "lra_text": ("bert", "first", True, False),
    "lra_retrieval": ("default", "first", True, False),
    "lra_image": ("default", "mean", False, True),
    "lra_pathfinder": ("default", "mean", False, True),
    "lra_pathx": ("default", "mean", False, True),
}


@pytest.mark.parametrize("name", sorted(LRA_ARCHS))
def test_transformer_lra_configs_follow_the_fairseq_archs(compose_cfg, name: str) -> None:
    init, pooling, cls, pixel_scale = LRA_ARCHS[name]
    cfg = compose_cfg(f"experiment=transformer/{name}")
    model = cfg.model
    assert model.encoder.init == model.backbone.init == init
    assert model.backbone.embed_norm is True and model.backbone.prenorm is False
    assert cfg.task.pooling == pooling
    assert bool(cfg.data.get("prepend_cls", False)) is cls
    assert bool(model.encoder.get("feature_scale")) is pixel_scale
    assert bool(model.encoder.get("token_scale")) is not pixel_scale
    if name == "lra_listops":
        assert cfg.data.max_len == 2002 and model.backbone.share_layers is True


# A classification, a retrieval, a language-modelling and a translation task.
EVERY_TASK = ["megalodon/lra_pathx", "transformer/lra_retrieval", "mega/enwik8", "mega/wmt16_en_de"]


@pytest.mark.parametrize("experiment", EVERY_TASK)
def test_every_metric_state_lives_on_the_module_device(compose_cfg, experiment: str) -> None:
    """torchmetrics syncs metric states over the process group, and NCCL has no CPU backend: a
    state left on the CPU stops a DDP run on GPUs at its first validation. Every state and
    every reset default follows the module to a device (`meta` here, for any device), and one
    left behind (restored, or made without a device) is moved back when a loop starts."""
    import hydra
    from torchmetrics import Metric

    from megalab.tasks.base import metrics_to_device

    cfg = compose_cfg(f"experiment={experiment}")
    task = hydra.utils.instantiate(cfg.task).to("meta")
    metrics = {n: m for n, m in task.named_modules() if isinstance(m, Metric)}
    assert metrics
    for metric in metrics.values():
        for value in [*metric.metric_state.values(), *metric._defaults.values()]:
            for t in value if isinstance(value, list) else [value]:
                assert t.device.type == "meta"
    assert metrics_to_device(task, task.device) == []

    stray = next(iter(metrics.values()))
    key = next(iter(stray._defaults))
    setattr(stray, key, torch.zeros_like(stray._defaults[key], device="cpu"))
    task.on_validation_start()  # what a loop's start does
    assert getattr(stray, key).device.type == "meta"
    assert metrics_to_device(task, task.device) == []


def test_corpus_bleu_is_computed_on_its_states_device() -> None:
    from megalab.generation.bleu import CorpusBLEU

    bleu = CorpusBLEU()
    bleu.update(["a b c d"], ["a b c d"])
    score = bleu.compute()
    assert score.device == bleu.correct.device and float(score) == pytest.approx(100.0)


def test_a_compiled_tasks_checkpoint_holds_plain_names_and_loads_either_way() -> None:
    """`task.compile=true` wraps the backbone in torch.compile's `_orig_mod`, and checkpoints
    held those names: megalab-eval, export and init_from, which build the task uncompiled,
    refused them as weights of another model. They are saved by plain names now, and a
    checkpoint written before loads too."""
    torch.manual_seed(0)
    compiled = ClassificationTask(*_parts(), num_classes=3, compile=True)
    compiled.setup("fit")
    assert any("_orig_mod." in k for k in compiled.state_dict())
    checkpoint = {"state_dict": compiled.state_dict()}
    compiled.on_save_checkpoint(checkpoint)
    assert not any("_orig_mod" in k for k in checkpoint["state_dict"])
    for state in (checkpoint["state_dict"], compiled.state_dict()):  # saved now, and before
        torch.manual_seed(1)
        plain = ClassificationTask(*_parts(), num_classes=3)
        plain.load_state_dict(state, strict=True)
        for name, value in plain.state_dict().items():
            assert torch.equal(value, checkpoint["state_dict"][name]), name
    compiled.load_state_dict(plain.state_dict(), strict=True)  # resuming a compiled run


def test_every_task_takes_the_shared_options_and_compiles_its_own_module() -> None:
    """`optim`, `scheduler`, `check_finite` and `compile` reach `TaskBase` from every task;
    `compile` wraps the task's backbone (the seq2seq task's model) for training only."""
    from megalab.models.transformer.translation import TransformerEncoderDecoderConfig
    from megalab.tasks import LanguageModelingTask, Seq2SeqTask
    from megalab.tasks.base import TaskBase
    from megalab.tasks.language_modeling import LinearLMHead

    def scheduler(optimizer: object, total_steps: int) -> None:
        return None

    encoder, backbone, head = _parts()
    lm_backbone = TransformerConfig(d_model=8, num_layers=1, num_heads=2, ffn_dim=16,
                                    causal=True).build()  # fmt: skip
    model = TransformerEncoderDecoderConfig(12, 1, d_model=8, num_heads=2, ffn_dim=16,
                                            encoder_layers=1, decoder_layers=1).build()  # fmt: skip
    options = {"optim": {"optimizer": None}, "scheduler": scheduler, "check_finite": False}
    tasks = [
        (ClassificationTask(encoder, backbone, head, num_classes=3, **options, compile=True),
         "backbone"),
        (RetrievalTask(*_parts(), num_classes=3, **options, compile=True), "backbone"),
        (LanguageModelingTask(SequenceEncoder(8, vocab_size=12), lm_backbone,
                              LinearLMHead(8, 12), loss_scale=0.5, **options, compile=True),
         "backbone"),
        (Seq2SeqTask(model, **options, compile=True), "model"),
    ]  # fmt: skip
    for task, target in tasks:
        assert task.optim_cfg == options["optim"] and task.scheduler_fn is scheduler
        assert task.check_finite is False and task.compile_target == target
        module = getattr(task, target)
        task.setup("validate")
        assert getattr(task, target) is module
        task.setup("fit")
        assert getattr(task, target)._orig_mod is module, type(task).__name__
    plain = ClassificationTask(*_parts(), num_classes=3)
    assert plain.check_finite and not plain.compile_for_fit and plain.optim_cfg is None
    module = plain.backbone
    plain.setup("fit")
    assert plain.backbone is module
    with pytest.raises(ValueError, match="no module to compile"):
        TaskBase(compile=True)
