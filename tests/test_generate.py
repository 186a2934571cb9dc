"""megalab-generate: incremental decoding equals the full pass for every causal model config,
sampling filters, and text from a trained checkpoint of each causal model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from causal_models import CAUSAL_CASES, CAUSAL_IDS, VOCAB, build_lm
from conftest import run_cli
from megalab.cli.generate import generate
from megalab.cli.train import train
from megalab.data.lm.codec import AlphabetCodec, ByteCodec, WordCodec
from megalab.generation.sampling import filter_logits, next_token, sample_tokens
from megalab.long_context import score_stream


@pytest.mark.parametrize(("name", "variant"), CAUSAL_CASES, ids=CAUSAL_IDS)
@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 12, "top_p": 0.9}],
    ids=["greedy", "sampled"],
)
def test_incremental_decoding_equals_the_full_pass(name: str, variant: str, sampling) -> None:
    """The distribution each token was drawn from (prompt in one pass, then one token per
    step with the carried state, or the prefix re-read by a stateless model) is the full
    pass's distribution at that position."""
    task = build_lm(name, variant)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=g)
    tokens, dists = sample_tokens(
        task, prompt, 14, generator=torch.Generator().manual_seed(1), return_log_probs=True,
        **sampling,
    )  # fmt: skip
    assert tokens.shape == (2, 14) and dists.shape == (2, 14, VOCAB)
    seq = torch.cat([prompt, tokens[:, :-1]], 1)
    with torch.no_grad():
        full = task.head.log_probs(task(seq).y)[:, 4:]
    torch.testing.assert_close(dists, full.float(), rtol=1e-5, atol=1e-5)
    if sampling["temperature"] == 0:
        assert (tokens == full.argmax(-1)).all()


def test_filters_keep_the_top_k_and_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [[True, True, False, False, False]]
    # 0.5 + 0.2 = 0.7 < 0.8, so the nucleus needs the third token too.
    kept = torch.isfinite(filter_logits(logits, top_p=0.8))
    assert kept.tolist() == [[True, True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.1)).sum() == 1  # the top token stays
    assert torch.isfinite(filter_logits(logits, top_k=3, top_p=0.6)).sum() == 2
    assert next_token(logits, temperature=0.0).item() == 0
    draws = {next_token(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(s)).item()
             for s in range(40)}  # fmt: skip
    assert draws == {0, 1}
    with pytest.raises(ValueError, match="temperature"):
        next_token(logits, temperature=-1.0)


def test_sampling_and_scoring_give_the_task_back_in_its_mode() -> None:
    """Sampling or scoring from a training loop (a callback's samples) runs without dropout and
    leaves each module's mode as it was: both left the whole task in eval mode, so training
    went on without dropout; a module the caller froze in eval stays frozen."""
    task = build_lm("llama", "causal_mha", dtype=torch.float32).train()
    task.encoder.eval()  # frozen by the caller
    modes = {name: m.training for name, m in task.named_modules()}
    dropouts = [m for m in task.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts
    for m in dropouts:
        m.p = 0.5
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(0))
    greedy = [sample_tokens(task, prompt, 6, temperature=0.0) for _ in range(2)]
    assert torch.equal(*greedy)  # no dropout while sampling
    assert {name: m.training for name, m in task.named_modules()} == modes
    score_stream(task, np.arange(30) % VOCAB, segment_len=8, first_bucket=8)
    assert {name: m.training for name, m in task.named_modules()} == modes


def test_a_seed_makes_sampling_reproducible_and_eos_stops_it() -> None:
    task = build_lm("llama", "causal_mha", dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(2))

    def run(seed: int, **kw):
        return sample_tokens(task, prompt, 20, 1.0, generator=torch.Generator().manual_seed(seed),
                             **kw)  # fmt: skip

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))
    first = run(7)[0, 2].item()
    stopped = run(7, eos_id=first)
    row = stopped[0].tolist()
    assert row[2] == first and all(t == first for t in row[2:])
    assert stopped.shape[1] <= 20


def test_codecs_round_trip_text() -> None:
    assert ByteCodec().decode(ByteCodec().encode("héllo\nworld")) == "héllo\nworld"
    assert ByteCodec(drop_newlines=True).encode("a\nb") == [97, 98]
    text8 = AlphabetCodec(" abcdefghijklmnopqrstuvwxyz")
    assert text8.decode(text8.encode("Hello world")) == "hello world"
    with pytest.raises(ValueError, match=r"'!'"):
        text8.encode("hi!")
    words = WordCodec(["<eos>", "the", "cat", "<unk>"])
    ids = words.encode("the cat\nthe dog")
    assert ids == [1, 2, 0, 1, 3]
    assert words.decode(ids) == "the cat\nthe <unk>"


@pytest.mark.parametrize("kind", ["words", "unigram", "bpe", "bytes"])
def test_a_continuation_reads_after_its_prompt(kind: str) -> None:
    """megalab-generate printed a word-level continuation glued to its prompt ("the catw1807"):
    decoded alone, its first word (or a unigram tokenizer's first piece) has no space before it.
    Decoded after the prompt's last tokens, the prompt and the continuation read as one text."""
    from megalab.data.lm.codec import TokenizerCodec, continuation
    from megalab.data.lm.pg19 import train_tokenizer

    texts = ["the cat sat on the mat", "the dog sat on the log"] * 20
    if kind == "words":
        codec = WordCodec(["<eos>", "the", "cat", "sat", "on", "mat", "<unk>"])
    elif kind == "bytes":
        codec = ByteCodec()
    else:
        codec = TokenizerCodec(train_tokenizer(iter(texts), kind, 40, "<eos>"), "<eos>")
    # What a model continues with: bytes and byte-level BPE carry the space in a token.
    rest = codec.encode("sat on the mat" if kind in ("words", "unigram") else " sat on the mat")
    prompt = codec.encode("the cat")
    assert codec.decode(prompt) + continuation(codec, prompt, rest) == "the cat sat on the mat"
    if kind in ("words", "unigram"):
        assert not codec.decode(rest).startswith(" ")  # the space that went missing
        assert continuation(codec, prompt, rest).startswith(" ")


# --------------------------------------------------------------------------- from checkpoints
_TINY = {
    "mega": [
        "model=mega",
        "model.d_model=16",
        "model.backbone.num_layers=1",
        "model.backbone.z_dim=8",
        "model.backbone.v_dim=16",
        "model.backbone.ffn_dim=16",
        "model.backbone.causal=true",
        "model.backbone.prenorm=true",
        "model.backbone.chunk_size=8",
        "model.backbone.rel_pos_bias=rotary",
    ],
    "transformer": [
        "model=transformer",
        "model.d_model=16",
        "model.backbone.num_layers=1",
        "model.backbone.num_heads=2",
        "model.backbone.ffn_dim=16",
        "model.backbone.causal=true",
    ],
    "llama": [
        "model=llama",
        "model.d_model=16",
        "model.backbone.num_layers=1",
        "model.backbone.num_heads=2",
        "model.backbone.num_kv_heads=1",
        "model.backbone.ffn_dim=24",
    ],
}
_DATA = {
    "enwik8": ["data=enwik8", "data.sha256=null", "data.valid_size=3000", "data.test_size=3000"],
    "text8": ["data=text8", "data.sha256=null", "data.valid_size=3000", "data.test_size=3000"],
    "pg19": ["data=pg19", "data.vocab_size=400", "data.tokenizer_sample_books=null"],
    "wikitext103": ["data=wikitext103", "data.vocab_size=61056"],  # the fixture's vocabulary
}


@pytest.mark.parametrize(
    ("model", "data"),
    [("mega", "enwik8"), ("transformer", "text8"), ("llama", "pg19"), ("llama", "wikitext103")],
)
def test_generates_text_from_a_trained_checkpoint(compose_cfg, tmp_path, model, data) -> None:
    overrides = [*_TINY[model], *_DATA[data], "task=language_modeling", "data.max_len=32",
                 "data.batch_size=4", "data.eval_batch_size=2"]  # fmt: skip
    record = train(compose_cfg(*overrides))
    assert record["global_step"] == 2
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    cfg = compose_cfg(
        *overrides,
        f"ckpt_path={ckpt}",
        "prompt=the quick brown fox",
        "max_new_tokens=12",
        "temperature=0.8",
        "top_p=0.95",
        "stop_at_eos=false",
        config="generate",
        fast=False,
    )
    printed: list[str] = []
    out = generate(cfg, print_fn=printed.append)
    assert out["new_tokens"] == 12 and len(out["samples"]) == 1
    assert "".join(printed).startswith("the quick brown fox")
    if data == "wikitext103":  # words: the continuation's first word is not glued to "fox"
        assert "".join(printed)[len("the quick brown fox")] in " \n"
    assert "".join(printed).rstrip("\n").endswith(out["samples"][0].rstrip("\n")[-3:])
    saved = json.loads((tmp_path / "run" / "generations.json").read_text())
    assert saved["tokens"] == out["tokens"] and saved["settings"]["top_p"] == 0.95
    again = generate(cfg, print_fn=lambda s: None)
    assert again["tokens"] == out["tokens"]  # seeded


def test_the_command_line_uses_the_run_config(compose_cfg, tmp_path: Path) -> None:
    overrides = [*_TINY["llama"], *_DATA["enwik8"], "task=language_modeling", "data.max_len=32",
                 "data.batch_size=4", "data.eval_batch_size=2"]  # fmt: skip
    run_cfg = compose_cfg(*overrides)
    train(run_cfg)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(exist_ok=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(run_cfg))
    proc = run_cli(
        "-m",
        "megalab.cli.generate",
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        "prompt=Once upon a time",
        "max_new_tokens=8",
        "num_samples=2",
        "temperature=1.0",
        # a key of the run's data (enwik8) that the command's default group (PG-19) lacks
        "data.drop_newlines=false",
        f"hydra.run.dir={tmp_path / 'gen'}",  # the data: the run's own folder (no paths.data_dir)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("--- sample") == 2 and "Once upon a time" in proc.stdout
    record = json.loads((tmp_path / "gen" / "generations.json").read_text())
    assert len(record["tokens"]) == 2 and all(len(t) == 8 for t in record["tokens"])


def test_overrides_of_the_run_configs_keys_compose_and_misspelled_ones_name_its_keys(
    tmp_path: Path,
) -> None:
    """Hydra checks an evaluation's overrides against the command's default groups before the
    run's config replaces them: keys only the run has are marked `++`, and a misspelled one is
    answered with the run's closest keys."""
    from megalab.run_loading import run_config_in_argv, run_overrides_composable
    from megalab.utils.errors import explain_composition_error

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    run_cfg = {
        "data": {"eval_max_len": None, "max_len": 64},
        "model": {"backbone": {"chunk_size": 32}},
    }
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(run_cfg)))
    ckpt = f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
    argv = [ckpt, "data.eval_max_len=256", "model.backbone.chunk_size=64", "data=enwik8",
            "+data.extra=1", "data.eval_max_lenn=2", "trainer.max_steps=1", "-m"]  # fmt: skip
    found = run_config_in_argv(argv)
    assert found is not None
    assert run_overrides_composable(argv, found) == [
        ckpt, "++data.eval_max_len=256", "++model.backbone.chunk_size=64", "data=enwik8",
        "+data.extra=1", "data.eval_max_lenn=2", "trainer.max_steps=1", "-m",
    ]  # fmt: skip
    assert run_config_in_argv([*argv, "use_run_config=false"]) is None
    assert run_config_in_argv(["ckpt_path=/nowhere/last.ckpt"]) is None
    hint = explain_composition_error("eval", [ckpt, "data.eval_max_lenn=2"], found)
    assert hint is not None and "did you mean: data.eval_max_len" in hint, hint


def test_generate_refuses_a_run_that_is_not_a_language_model(compose_cfg, tmp_path) -> None:
    """A classifier's run and checkpoint load, then fail with what megalab-generate needs."""
    import hydra

    from megalab.run_loading import load_task
    from megalab.utils.checkpointing import write_checkpoint

    overrides = ["task=classification", "data=lra_listops", "model=mega", "model.d_model=16",
                 "model.backbone.num_layers=1", "model.backbone.z_dim=8",
                 "model.backbone.v_dim=16", "model.backbone.ffn_dim=16"]  # fmt: skip
    ckpt = tmp_path / "classifier.ckpt"
    cfg = compose_cfg(f"ckpt_path={ckpt}", *overrides, config="generate", fast=False)
    write_checkpoint({"state_dict": hydra.utils.instantiate(cfg.task).state_dict()}, ckpt)
    with pytest.raises(ValueError, match="ClassificationTask is not a language model"):
        load_task(cfg, torch.device("cpu"), torch.float32)
    # The command itself says so before it reads the data (a classifier's has no text codec).
    with pytest.raises(ValueError, match="not a language model: megalab-generate needs"):
        generate(cfg)


@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [
        ("temperature=-1", ValueError, "temperature must be >= 0"),
        ("top_p=0", ValueError, r"top_p must be in \(0, 1\]"),
        ("top_p=1.5", ValueError, r"top_p must be in \(0, 1\], got 1.5"),
        ("prompt_file={tmp}/nope.txt", FileNotFoundError, "prompt_file not found"),
    ],
)
def test_settings_that_cannot_sample_fail_before_anything_is_read_or_shown(
    compose_cfg, tmp_path: Path, setting: str, error: type, message: str
) -> None:
    """The prompt used to be shown, and the model loaded, before a bad temperature failed."""
    cfg = compose_cfg("task=language_modeling", *_DATA["enwik8"], "prompt=x",
                      f"ckpt_path={tmp_path / 'never_read.ckpt'}", setting.format(tmp=tmp_path),
                      config="generate", fast=False)  # fmt: skip
    printed: list[str] = []
    with pytest.raises(error, match=message):
        generate(cfg, print_fn=printed.append)
    assert printed == []
