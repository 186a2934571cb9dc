"""The seq2seq task end to end on the WMT fixture (small models), and `megalab-translate`.

The experiment configs themselves (Mega-base, Transformer-base) train in
tests/test_experiments.py; here the same configs run with small models so that every path
(training, validation BLEU, test BLEU and SacreBLEU, checkpoints, translation of a file) is
exercised in seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megalab.cli.train import train
from megalab.cli.translate import CheckpointError, load_translator
from megalab.cli.translate import main as translate_main
from megalab.generation.beam import GenerationConfig, SpecialTokens, beam_search
from megalab.tasks.seq2seq import Seq2SeqTask, decoder_inputs
from megalab.utils.checkpointing import write_checkpoint

SMALL = {
    "mega/wmt16_en_de": [
        "model.d_model=32",
        "model.encoder_decoder.encoder_layers=1",
        "model.encoder_decoder.decoder_layers=2",
        "model.encoder_decoder.z_dim=16",
        "model.encoder_decoder.v_dim=64",
        "model.encoder_decoder.ffn_dim=64",
        "model.encoder_decoder.ema_dim=4",
    ],
    "transformer/wmt16_en_de": [
        "model.d_model=32",
        "model.encoder_decoder.num_heads=4",
        "model.encoder_decoder.ffn_dim=64",
        "model.encoder_decoder.encoder_layers=1",
        "model.encoder_decoder.decoder_layers=2",
    ],
}
FIXTURE = [
    "data.vocab_size=256",
    "data.batch_size=8",
    "data.eval_batch_size=8",
    "task.generation.max_len_b=25",
    "task.val_generation.max_len_b=25",
]


def run(compose_cfg, experiment: str, *extra: str) -> tuple[dict, Path]:
    cfg = compose_cfg(f"experiment={experiment}", *SMALL[experiment], *FIXTURE, *extra)
    record = train(cfg)
    return record, Path(cfg.paths.output_dir)


@pytest.mark.parametrize("experiment", sorted(SMALL))
def test_trains_reports_bleu_and_translates_a_file(
    compose_cfg, experiment: str, tmp_path: Path
) -> None:
    record, out = run(compose_cfg, experiment)
    metrics = record["metrics"]
    assert record["global_step"] == 2
    for key in ("train/loss", "val/loss", "val/bleu", "test/loss", "test/bleu", "test/sacrebleu"):
        assert key in metrics and math.isfinite(metrics[key]), key
    saved = json.loads((out / "metrics.json").read_text())
    sacre = saved["sacrebleu"]
    assert sacre["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert sacre["sentences"] == 8  # one test batch (limit_test_batches=1)
    hyp = (out / "translations" / "test.hyp.de").read_text().split("\n")[:-1]
    assert len(hyp) == 8

    ckpt = Path(record["best_checkpoint"])
    loaded = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert loaded["seq2seq_model"]["class"] in ("MegaEncoderDecoder", "TransformerEncoderDecoder")
    assert loaded["text_pipeline"]["target_lang"] == "de"

    source = tmp_path / "in.en"
    # a blank line (a paragraph break) stays blank, in its place
    source.write_text("The house is big.\n\nMy friend was very nice, and the e-mail is new.\n")
    target = tmp_path / "out.de"
    code = translate_main([
        "--checkpoint", str(ckpt), "--input", str(source), "--output", str(target),
        "--max-len-b", "20", "--device", "cpu",
    ])  # fmt: skip
    assert code == 0
    lines = target.read_text().split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[-1] == ""
    assert lines[0] and lines[2]

    # The CLI's translation of a sentence is the best beam of the checkpoint's model.
    model, pipeline = load_translator(ckpt)
    src = torch.tensor(pipeline.encode(["The house is big."]))
    cfg = GenerationConfig(beam=5, len_penalty=0.5, max_len_b=20)
    best = beam_search(model, src, None, cfg, SpecialTokens(eos=2, pad=1, unk=3))[0][0]
    assert lines[0] == pipeline.detokenize(pipeline.decode(best.tokens.tolist()))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--input", "missing.en"], "--input missing.en: no such file"),
        (["--output", "no/such/folder/out.de"], "its folder does not exist"),
        (["--beam", "0"], "--beam must be >= 1, got 0"),
        (["--min-len", "-1"], "--min-len must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--max-len-b", "-1"], "must be >= 0"),
        (["--device", "gpu"], "--device gpu: not a device name"),
    ],
)
def test_translate_refuses_bad_arguments_before_loading_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, arguments: list[str], message: str
) -> None:
    """One usage message and exit status 2, before the checkpoint (here: none) is read."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.en").write_text("The house is big.\n")
    argv = ["--checkpoint", "none.ckpt", "--input", "in.en", "--device", "cpu", *arguments]
    with pytest.raises(SystemExit) as exit_info:
        translate_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "Traceback" not in err


def test_translate_refuses_cuda_where_there_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "in.en").write_text("The house is big.\n")
    argv = ["--checkpoint", "none.ckpt", "--input", str(tmp_path / "in.en"), "--device", "cuda"]
    with pytest.raises(SystemExit):
        translate_main(argv)
    assert "--device cuda: no CUDA device here; use --device cpu" in capsys.readouterr().err


def test_validation_bleu_on_a_subset_from_a_second_loader(compose_cfg) -> None:
    record, _ = run(compose_cfg, "transformer/wmt16_en_de", "data.val_bleu_subset=5",
                    "trainer.limit_val_batches=2")  # fmt: skip
    metrics = record["metrics"]
    assert math.isfinite(metrics["val/bleu"]) and math.isfinite(metrics["val/loss"])
    assert not any("dataloader_idx" in k for k in metrics)


def test_label_smoothed_loss_is_fairseqs() -> None:
    """(1 − ε)·NLL + ε/V·Σ_v −log p_v summed over non-padded targets (fairseq 0.10)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    targets = torch.randint(4, 11, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    lprobs = F.log_softmax(logits, -1)
    eps, V = 0.1, 11
    nll = -lprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.sum(-1)
    expected = (((1 - eps) * nll + eps / V * smooth) * mask).sum()
    tgt = targets.masked_fill(~mask, 1)
    ours = F.cross_entropy(
        logits.view(-1, V), tgt.view(-1), ignore_index=1, label_smoothing=eps, reduction="sum"
    )
    assert torch.allclose(ours, expected)


def test_decoder_inputs_move_eos_to_the_front() -> None:
    targets = torch.tensor([[5, 6, 2], [7, 2, 1]])
    mask = targets.ne(1)
    assert decoder_inputs(targets, mask, eos_id=2).tolist() == [[2, 5, 6], [2, 7, 1]]


def test_the_task_needs_an_encoder_decoder() -> None:
    with pytest.raises(TypeError, match="encoder-decoder"):
        Seq2SeqTask(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_translate_refuses_checkpoints_naming_other_classes(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    # Checksummed, as megalab writes them: what refuses them is the class they name (a file
    # without a readable checksum is refused before it is read at all).
    write_checkpoint(
        {"state_dict": {}, "text_pipeline": {}, "seq2seq_model": {"class": "os.system",
                                                                 "config": {}}},
        bad,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match=r"os\.system"):
        load_translator(bad)
    write_checkpoint({"state_dict": {}}, bad)
    with pytest.raises(CheckpointError, match="task=seq2seq"):
        load_translator(bad)
    assert translate_main(["--checkpoint", str(bad), "--input", "-"]) == 2


def test_the_task_builds_the_model_from_its_config_with_overrides(compose_cfg) -> None:
    """`model.encoder_decoder` names the model's config class; an override reaches its field
    and the task builds the model from it."""
    import hydra

    from megalab.models.transformer.translation import (
        TransformerEncoderDecoder,
        TransformerEncoderDecoderConfig,
    )

    cfg = compose_cfg("experiment=transformer/wmt16_en_de", *SMALL["transformer/wmt16_en_de"],
                      *FIXTURE, "model.encoder_decoder.dropout=0.3")  # fmt: skip
    config = hydra.utils.instantiate(cfg.model.encoder_decoder)
    assert isinstance(config, TransformerEncoderDecoderConfig) and config.dropout == 0.3
    task = hydra.utils.instantiate(cfg.task)
    assert isinstance(task.model, TransformerEncoderDecoder) and task.model.config == config
    assert task.model.dropout.p == 0.3


def test_a_checkpoint_that_stores_the_old_keyword_arguments_translates_the_same(
    compose_cfg, tmp_path: Path
) -> None:
    """Checkpoints store the model's options by name (`seq2seq_model.config`), the names the
    constructors took as keyword arguments before their config objects: one written then
    loads into the same model and translates the same; options that build nothing are
    refused by name."""
    record, _ = run(compose_cfg, "transformer/wmt16_en_de")
    ckpt = torch.load(record["best_checkpoint"], map_location="cpu", weights_only=True)
    spec = ckpt["seq2seq_model"]
    assert spec["class"] == "TransformerEncoderDecoder"
    old_names = ["vocab_size", "pad_id", "d_model", "num_heads", "ffn_dim", "encoder_layers",
                 "decoder_layers", "dropout", "attention_dropout", "activation_dropout",
                 "activation", "prenorm", "max_source_positions", "max_target_positions",
                 "share_all_embeddings"]  # fmt: skip
    assert sorted(spec["config"]) == sorted(old_names)
    old = tmp_path / "old.ckpt"
    ckpt["seq2seq_model"] = {"class": spec["class"],
                             "config": {k: spec["config"][k] for k in old_names}}  # fmt: skip
    write_checkpoint(ckpt, old)
    model, pipeline = load_translator(record["best_checkpoint"])
    model_old, _ = load_translator(old)
    assert model_old.config == model.config
    src = torch.tensor(pipeline.encode(["The house is big."]))
    tgt = torch.tensor([[2, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model_old(src, None, tgt), model(src, None, tgt))
    ckpt["seq2seq_model"]["config"]["heads"] = 4
    write_checkpoint(ckpt, old)
    with pytest.raises(CheckpointError, match=r"old\.ckpt: its TransformerEncoderDecoder options"):
        load_translator(old)
