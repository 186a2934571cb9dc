"""Shareable models: `megalab-export` and `megalab.from_pretrained`, offline.

Every model config makes the round trip export -> from_pretrained with identical weights and
outputs; a trained run's card shows its metrics; a Hub id resolves from a pre-filled cache with
the Hub offline; the upload goes through a mocked Hub client; a stranger's folder builds only
megalab's classes and holds no pickle.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning
import pytest
import torch
from omegaconf import OmegaConf, open_dict

import megalab
from conftest import CONFIG_DIR
from megalab.cli.export import main
from megalab.cli.train import train
from megalab.pretrained import ExportError, export_run, from_pretrained
from megalab.utils.checkpointing import write_checkpoint
from megalab.utils.safe_config import UnsafeConfigError

MODELS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
SEQ2SEQ = sorted(f"seq2seq/{p.stem}" for p in (CONFIG_DIR / "model" / "seq2seq").glob("*.yaml"))
LM = ["data=enwik8", "task=language_modeling", "data.max_len=64", "data.eval_max_len=64",
      "data.sha256=null", "data.valid_size=3000", "data.test_size=3000"]  # fmt: skip
SMALL = ["model.d_model=64", "model.backbone.num_layers=2"]


def _model_overrides(compose_cfg, model: str) -> list[str]:
    """A small configuration of `model` on a task and fixture data it fits."""
    if model.startswith("seq2seq/"):
        return [f"model={model}", "task=seq2seq", "data=wmt16_en_de", "model.d_model=32",
                "model.encoder_decoder.encoder_layers=1",
                "model.encoder_decoder.decoder_layers=1"]  # fmt: skip
    base = [f"model={model}", *SMALL]
    if model.startswith("llama_"):
        base.append("model.backbone.num_heads=4")
    model_cfg = compose_cfg(*base).model
    if not model_cfg.backbone.get("causal", False):
        return base
    head = ["task.head=${model.lm_head}"] if "lm_head" in model_cfg else []
    return [*base, *LM, *head]


def _fake_run(cfg: Any, run: Path, seed: int = 0) -> Any:
    """A run folder as megalab-train leaves it: its config and a checksummed checkpoint of a
    task whose weights are moved off their initialisation."""
    torch.manual_seed(seed)
    task = hydra.utils.instantiate(cfg.task)
    with torch.no_grad():
        for p in task.parameters():
            p.add_(0.05 * torch.randn_like(p))
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    saved = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(saved, dict)
    saved.pop("hydra", None)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    (run / ".hydra" / "overrides.yaml").write_text("- model=test\n")
    state = {"state_dict": task.state_dict(), "global_step": 7,
             "pytorch-lightning_version": lightning.__version__}  # fmt: skip
    write_checkpoint(state, run / "checkpoints" / "last.ckpt")
    return task.eval()


def _same_outputs(a: Any, b: Any, cfg: Any) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    if cfg.task._target_.endswith("Seq2SeqTask"):
        return  # weights above; its forward needs the data's text pipeline
    vocab = int(cfg.data.vocab_size or 0)
    g = torch.Generator().manual_seed(1)
    if vocab:
        x = torch.randint(1, vocab, (2, 24), generator=g)
    else:
        x = torch.randn(2, 24, int(cfg.data.d_input), generator=g)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 20:] = False
    with torch.no_grad():
        torch.testing.assert_close(b.encode(x, mask).y, a.encode(x, mask).y, rtol=0, atol=0)


# Size presets (llama_100m ... llama_7b: the llama code path at other sizes) run in the slow suite.
CASES = [pytest.param(m, marks=pytest.mark.slow) if m.startswith("llama_") else m
         for m in MODELS + SEQ2SEQ]  # fmt: skip


@pytest.mark.parametrize("model", CASES)
def test_every_model_config_round_trips(compose_cfg, tmp_path: Path, model: str) -> None:
    cfg = compose_cfg(*_model_overrides(compose_cfg, model))
    task = _fake_run(cfg, tmp_path / "run")
    out = export_run(tmp_path / "run", tmp_path / "export", checkpoint="last",
                     with_tokenizer=not model.startswith("seq2seq/"))  # fmt: skip
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [
        "README.md", "config.json", "model.safetensors"
    ]  # fmt: skip
    header = (out / "model.safetensors").read_bytes()[:9]
    assert header[8:9] == b"{", "safetensors: an 8-byte length, then a JSON header (no pickle)"
    loaded = from_pretrained(out)
    assert not loaded.training
    _same_outputs(task, loaded, cfg)


def test_trained_run_card_shows_its_metrics(compose_cfg, tmp_path: Path) -> None:
    cfg = compose_cfg()
    train(cfg)
    run = tmp_path / "run"
    record = json.loads((run / "metrics.json").read_text())
    out = export_run(run, tmp_path / "export")  # the best checkpoint, by default
    card = (out / "README.md").read_text()
    config = json.loads((out / "config.json").read_text())
    for key, value in record["metrics"].items():
        if isinstance(value, float):
            assert f"| `{key}` | {value:.4f} |" in card, key
    assert f"{record['params']['total']:,} parameters" in card
    assert "Touvron" not in card and "Vaswani et al. 2017" in card  # the model's own paper
    assert config["megalab_version"] == megalab.__version__
    assert config["command"].startswith("python -m megalab.cli.train")
    assert Path(record["best_checkpoint"]).name == config["checkpoint"]["file"]
    loaded = megalab.from_pretrained(str(out))
    reference = hydra.utils.instantiate(cfg.task)
    best = torch.load(record["best_checkpoint"], weights_only=True)
    reference.load_state_dict(best["state_dict"])
    _same_outputs(reference.eval(), loaded, cfg)


def test_export_runs_outside_hydra_on_the_run_folder_hydra_wrote(
    compose_cfg, tmp_path: Path
) -> None:
    """A run's `.hydra/config.yaml` keeps `${hydra:...}` values, which resolve inside a Hydra
    app only: `megalab-export`, a plain command, takes the experiment from metrics.json."""
    from hydra.core.hydra_config import HydraConfig

    cfg = compose_cfg("model=mega", *SMALL, *LM, "model.backbone.causal=true")
    _fake_run(cfg, tmp_path / "run")
    (tmp_path / "run" / "metrics.json").write_text(json.dumps({"experiment": "mega/enwik8"}))
    HydraConfig.instance().cfg = None  # as in a fresh `megalab-export` process
    out = export_run(tmp_path / "run", tmp_path / "export", "last")
    assert json.loads((out / "config.json").read_text())["experiment"] == "mega/enwik8"


def test_tokenizer_files_travel_with_the_model(compose_cfg, tmp_path: Path) -> None:
    """WikiText-103's vocabulary is exported beside the weights (`tokenizer/vocab.txt`)."""
    cfg = compose_cfg("model=transformer_xl", *SMALL, "data=wikitext103", "task=language_modeling",
                      "data.max_len=64", "data.eval_max_len=64", "data.vocab_size=61056",
                      "task.head=${model.lm_head}")  # fmt: skip
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.prepare_data()
    _fake_run(cfg, tmp_path / "run")
    out = export_run(tmp_path / "run", tmp_path / "export", checkpoint="last")
    vocab = datamodule.tokenizer_files()["vocab.txt"]
    assert (out / "tokenizer" / "vocab.txt").read_bytes() == vocab.read_bytes()
    assert json.loads((out / "config.json").read_text())["tokenizer"] == ["vocab.txt"]


SPLITS = ["data.sha256=null", "data.valid_size=3000", "data.test_size=3000"]


@pytest.mark.parametrize(
    "data",
    [
        ["data=enwik8", "data.drop_newlines=true", *SPLITS],
        ["data=text8", *SPLITS],
        ["data=wikitext103", "data.vocab_size=61056"],
        ["data=pg19", "data.vocab_size=400", "data.tokenizer_sample_books=null"],
    ],
    ids=["bytes", "alphabet", "words", "tokenizer"],
)
def test_an_export_gives_its_text_codec(compose_cfg, tmp_path: Path, data: list[str]) -> None:
    """An export shipped its vocabulary files but nothing to read them with: a model from the
    Hub could not be given a prompt in Python without knowing the data's codec classes."""
    cfg = compose_cfg("model=mega", *SMALL, *data, "task=language_modeling", "data.max_len=64",
                      "data.eval_max_len=64", "model.backbone.causal=true")  # fmt: skip
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.prepare_data()
    _fake_run(cfg, tmp_path / "run")
    out = export_run(tmp_path / "run", tmp_path / "export", checkpoint="last")
    codec, theirs = megalab.text_codec(str(out)), datamodule.text_codec()
    text = "the cat sat on the mat and the dog"
    assert type(codec) is type(theirs)
    assert codec.encode(text) == theirs.encode(text) and codec.eos_id == theirs.eos_id
    assert codec.decode(codec.encode(text)) == theirs.decode(theirs.encode(text))
    assert "codec = megalab.text_codec(" in (out / "README.md").read_text()


def test_an_export_without_text_says_so(compose_cfg, tmp_path: Path) -> None:
    out, _, _ = _export(compose_cfg, tmp_path)  # ListOps: tokens of a classification task
    with pytest.raises(ExportError, match="records no text codec"):
        megalab.text_codec(str(out))
    assert "text_codec" not in (out / "README.md").read_text()


def test_a_strangers_text_codec_reads_only_its_own_tokenizer_files(
    compose_cfg, tmp_path: Path
) -> None:
    """config.json is data: a codec naming a file outside `tokenizer/` is refused."""
    out, _, _ = _export(compose_cfg, tmp_path)
    record = json.loads((out / "config.json").read_text())
    record["text"] = {"kind": "tokenizer", "file": "../config.json", "eos_token": None}
    refusals = [
        ([], "exported with --without-tokenizer"),
        (["../config.json"], "which is not one of its tokenizer files"),
    ]
    for listed, message in refusals:
        record["tokenizer"] = listed
        (out / "config.json").write_text(json.dumps(record))
        with pytest.raises(ExportError, match=message):
            megalab.text_codec(str(out))


def _export(compose_cfg, tmp_path: Path) -> tuple[Path, Any, Any]:
    cfg = compose_cfg("model=mega", *SMALL)
    task = _fake_run(cfg, tmp_path / "run")
    return export_run(tmp_path / "run", tmp_path / "export", checkpoint="last"), task, cfg


def test_an_export_that_names_the_backbone_class_still_loads(compose_cfg, tmp_path: Path) -> None:
    """An export written before backbones took their config object names the backbone class
    with its options beside it: it loads as the config class, with a warning, unchanged."""
    out, task, cfg = _export(compose_cfg, tmp_path)
    record = json.loads((out / "config.json").read_text())
    assert record["task"]["backbone"]["_target_"] == "megalab.models.mega.MegaConfig"
    record["task"]["backbone"]["_target_"] = "megalab.models.mega.Mega"
    (out / "config.json").write_text(json.dumps(record))
    with pytest.warns(FutureWarning, match="name its config class instead.*MegaConfig"):
        loaded = from_pretrained(out)
    _same_outputs(task, loaded, cfg)


def test_exporting_an_old_run_writes_the_config_class(compose_cfg, tmp_path: Path) -> None:
    """A run folder from before backbones took their config object exports with the config
    class as its target, so the export loads without the deprecation warning."""
    cfg = compose_cfg("model=mega", *SMALL)
    task = _fake_run(cfg, tmp_path / "run")
    saved = tmp_path / "run" / ".hydra" / "config.yaml"
    saved.write_text(saved.read_text().replace("megalab.models.mega.MegaConfig",
                                               "megalab.models.mega.Mega"))  # fmt: skip
    with pytest.warns(FutureWarning, match="name its config class instead.*MegaConfig"):
        out = export_run(tmp_path / "run", tmp_path / "export", checkpoint="last")
    record = json.loads((out / "config.json").read_text())
    assert record["task"]["backbone"]["_target_"] == "megalab.models.mega.MegaConfig"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        loaded = from_pretrained(out)
    _same_outputs(task, loaded, cfg)


@pytest.mark.parametrize("model", SEQ2SEQ)
def test_an_export_that_names_the_encoder_decoder_class_still_loads(
    compose_cfg, tmp_path: Path, model: str
) -> None:
    """An export written before the encoder-decoders took their config object names the model
    class with its options beside it: it loads as the config class, with a warning, and
    translates as before (same weights, same logits)."""
    cfg = compose_cfg(*_model_overrides(compose_cfg, model))
    task = _fake_run(cfg, tmp_path / "run")
    out = export_run(tmp_path / "run", tmp_path / "export", checkpoint="last",
                     with_tokenizer=False)  # fmt: skip
    record = json.loads((out / "config.json").read_text())
    new = record["task"]["model"]["_target_"]
    assert new.endswith("EncoderDecoderConfig")
    old = new.removesuffix("Config")
    record["task"]["model"]["_target_"] = old
    (out / "config.json").write_text(json.dumps(record))
    with pytest.warns(FutureWarning, match=f"`_target_: {old}`.*`_target_: {new}`"):
        loaded = from_pretrained(out)
    assert type(loaded.model) is type(task.model) and loaded.model.config == task.model.config
    _same_outputs(task, loaded, cfg)
    g, vocab = torch.Generator().manual_seed(1), task.model.vocab_size
    src = torch.randint(4, vocab, (2, 9), generator=g)
    tgt = torch.randint(4, vocab, (2, 7), generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(src, mask, tgt), task.model(src, mask, tgt),
                                   rtol=0, atol=0)  # fmt: skip


def test_hub_id_resolves_from_the_cache_offline(
    compose_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`from_pretrained("user/name")` with HF_HUB_OFFLINE=1 takes the cached snapshot."""
    import huggingface_hub.constants

    out, task, cfg = _export(compose_cfg, tmp_path)
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--someone--tiny-mega"
    shutil.copytree(out, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _same_outputs(task, from_pretrained("someone/tiny-mega", cache_dir=str(cache)), cfg)
    with pytest.raises(ExportError, match="could not be fetched"):
        from_pretrained("someone/not-cached", cache_dir=str(cache))


def test_push_to_hub_uploads_the_folder(
    compose_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import huggingface_hub

    calls: list[tuple[str, dict[str, Any]]] = []

    class FakeApi:
        def create_repo(self, **kwargs: Any) -> None:
            calls.append(("create_repo", kwargs))

        def upload_folder(self, **kwargs: Any) -> Any:
            calls.append(("upload_folder", kwargs))
            return type("Info", (), {"commit_url": "https://hub.example/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    cfg = compose_cfg("model=mega", *SMALL)
    _fake_run(cfg, tmp_path / "run")
    out = tmp_path / "export"
    argv = [str(tmp_path / "run"), str(out), "--checkpoint", "last"]
    assert main([*argv, "--push-to-hub", "someone/tiny-mega", "--private"]) == 0
    assert calls[0] == ("create_repo", {"repo_id": "someone/tiny-mega", "private": True,
                                        "exist_ok": True})  # fmt: skip
    assert calls[1][0] == "upload_folder"
    assert calls[1][1]["folder_path"] == str(out) and calls[1][1]["repo_id"] == "someone/tiny-mega"
    assert "uploaded: https://hub.example/commit/1" in capsys.readouterr().out


def test_a_strangers_folder_builds_only_megalab_classes(compose_cfg, tmp_path: Path) -> None:
    out, _, _ = _export(compose_cfg, tmp_path)
    record = json.loads((out / "config.json").read_text())
    marker = tmp_path / "ran"
    record["task"]["backbone"] = {"_target_": "os.system", "command": f"touch {marker}"}
    (out / "config.json").write_text(json.dumps(record))
    with pytest.raises(UnsafeConfigError):
        from_pretrained(out)
    record["task"]["backbone"] = {"_target_": "megalab.models.mega.Mega", "d_model": "${oc.env:X}"}
    (out / "config.json").write_text(json.dumps(record))
    with pytest.raises(ExportError, match="interpolation"):
        from_pretrained(out)
    (out / "config.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ExportError, match="not a megalab export"):
        from_pretrained(out)
    assert not marker.exists()


def test_export_refuses_a_run_without_config_in_one_message(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "is not a megalab run folder" in err and "Traceback" not in err


def test_llama_exports_for_transformers(compose_cfg, tmp_path: Path) -> None:
    """`megalab-export --format hf` writes a folder transformers loads, with equal logits."""
    transformers = pytest.importorskip("transformers", reason="the hf format needs transformers")
    cfg = compose_cfg("model=llama", *SMALL, "model.backbone.num_heads=4", *LM,
                      "task.tie_weights=false")  # fmt: skip
    with open_dict(cfg):
        cfg.data.vocab_size = 256
    task = _fake_run(cfg, tmp_path / "run")
    argv = [str(tmp_path / "run"), str(tmp_path / "hf"), "--checkpoint", "last", "--format", "hf"]
    assert main(argv) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = task.head.proj(task(tokens).y)
        torch.testing.assert_close(hf(tokens).logits, ours, rtol=1e-5, atol=1e-5)


def test_the_hf_format_of_another_model_says_which_format_holds_it(
    compose_cfg, tmp_path: Path, capsys
) -> None:
    _fake_run(compose_cfg("model=mega", *SMALL), tmp_path / "run")
    argv = [str(tmp_path / "run"), str(tmp_path / "hf"), "--checkpoint", "last", "--format", "hf"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "not a Llama: the Hugging Face transformers format holds Llamas only" in err
    assert "megalab-export's default format" in err and "Traceback" not in err
