"""Generate text from a language-model checkpoint: `megalab-generate ckpt_path=<ckpt> prompt=...`.

    megalab-generate ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt \\
        prompt="It was a dark and stormy night" max_new_tokens=200 temperature=0.8 top_p=0.95

The prompt (`prompt=` text, or `prompt_file=` a UTF-8 file) is encoded with the tokenizer of
the run's data config (`text_codec()` of the LM DataModule: PG-19's subword tokenizer,
WikiText-103's words, enwik8's bytes, text8's characters), the model reads it in one pass and
then decodes one token at a time, printing the text as it grows (`stream=true`).

Decoding is incremental for every causal backbone with a state (Mega, Megalodon, Llama,
Transformer-XL/LaMemo: `initial_state`, then one token per call with the carried state): its
cost per token is that of one step, constant for Mega and Megalodon, growing with the context
for Llama's key/value cache. A stateless causal backbone (the Transformer decoder) re-reads the
whole prefix for every token (its last `max_len` tokens when it has a limit).

Sampling (applied in this order, as Hugging Face's `generate`): `temperature` (0: greedy,
argmax), `top_k` (keep the k most likely tokens), `top_p` (nucleus: the smallest set of most
likely tokens whose probability reaches p); `seed` makes it reproducible; `num_samples` draws
that many continuations in one batch. Generation stops at `max_new_tokens` or, with
`stop_at_eos`, when every sample has produced the data's end-of-document token.

The checkpoint's run folder supplies the data (the folder the run read), model and task configs,
checked by the loading policy as for `megalab-eval`; nothing is generated or downloaded unless
the command line asks;
`generations.json` in this command's output folder records the prompt, the samples and the
decoding speed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch import Tensor

from megalab.data.lm.codec import continuation
from megalab.generation.sampling import check_sampling, sample_tokens
from megalab.run_loading import check_run_vocabulary, merge_run_config, run_entry_point_of_a_run
from megalab.run_loading import load_task as load_task
from megalab.run_loading import pick_device as pick_device
from megalab.utils import errors
from megalab.utils.paths import CONFIG_DIR, export_project_root

log = logging.getLogger(__name__)

# `paths.root_dir` (data, logs) is the folder `megalab-train` uses, wherever this runs from.
export_project_root()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONTEXT_TOKENS = 8
"""The prompt's last tokens the continuation is decoded after (for the space between them)."""


def read_prompt(cfg: DictConfig) -> str:
    if cfg.get("prompt_file"):
        path = Path(cfg.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompt_file not found: {path}")
        return path.read_text(encoding="utf-8")
    return str(cfg.get("prompt") or "")


def generate(cfg: DictConfig, print_fn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Generate from `cfg.ckpt_path` as configured (see the module docstring); return a record
    of the prompt, the samples and the speed, also written to `generations.json`."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {cfg.dtype!r}; choose one of {sorted(DTYPES)}")
    if cfg.max_new_tokens < 1 or cfg.num_samples < 1:
        raise ValueError("max_new_tokens and num_samples must be >= 1")
    check_sampling(float(cfg.temperature), cfg.get("top_p"))
    text = read_prompt(cfg)  # a missing prompt_file fails before the model is loaded
    device = pick_device(str(cfg.device))
    # Before the data is read: the run's task must be a language model, the checkpoint whole.
    task = load_task(cfg, device, DTYPES[cfg.dtype])
    datamodule = hydra.utils.instantiate(cfg.data)
    check_run_vocabulary(cfg, datamodule, "megalab-generate")
    codec = datamodule.text_codec()
    ids = codec.encode(text)
    if not ids:
        if codec.eos_id is None:
            raise ValueError(
                "the prompt is empty and this data has no end-of-document token to start from: "
                "give prompt=... or prompt_file=..."
            )
        ids = [codec.eos_id]
    prompt = torch.tensor([ids] * int(cfg.num_samples), dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(int(cfg.seed))
    eos_id = codec.eos_id if cfg.stop_at_eos else None

    streamed: list[int] = []
    context = ids[-CONTEXT_TOKENS:]  # what the continuation's first piece is read after
    shown = [""]
    emit = print_fn or (lambda s: print(s, end="", flush=True))
    stream = bool(cfg.stream) and int(cfg.num_samples) == 1

    def on_tokens(tok: Tensor) -> None:
        if not stream:
            return
        streamed.append(int(tok[0]))
        text_now = continuation(codec, context, streamed)
        # Decode the whole continuation each time: a multi-byte character or a merged
        # subword may change the tail of the text when its next piece arrives.
        if text_now.startswith(shown[0]):
            emit(text_now[len(shown[0]) :])
            shown[0] = text_now

    if stream:
        emit(text)
    start = time.perf_counter()
    out = sample_tokens(
        task,
        prompt,
        int(cfg.max_new_tokens),
        float(cfg.temperature),
        cfg.get("top_k"),
        cfg.get("top_p"),
        generator,
        eos_id,
        on_tokens,
    )
    seconds = time.perf_counter() - start
    if stream:
        emit("\n")
    samples = [continuation(codec, context, row) for row in out.tolist()]
    if not stream:
        for i, sample in enumerate(samples):
            emit(f"--- sample {i} ---\n{text}{sample}\n")
    record = {
        "ckpt_path": str(cfg.ckpt_path),
        "prompt": text,
        "prompt_tokens": len(ids),
        "samples": samples,
        "tokens": out.tolist(),
        "new_tokens": int(out.numel()),
        "seconds": round(seconds, 4),
        "tokens_per_sec": round(out.numel() / seconds, 2) if seconds > 0 else None,
        "settings": {
            k: cfg.get(k) for k in ("temperature", "top_k", "top_p", "seed", "max_new_tokens")
        },
    }
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "generations.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="generate")
def hydra_main(cfg: DictConfig) -> None:
    """Hydra entry point: a refusal (missing or unreadable checkpoint, unsafe run config, bad
    setting) is printed as one message, as `megalab-eval` does."""
    with errors.reported():
        cfg = merge_run_config(cfg, list(HydraConfig.get().overrides.task))
        record = generate(cfg)
    log.info(
        "%d tokens in %.2f s (%s tokens/s)",
        record["new_tokens"],
        record["seconds"],
        record["tokens_per_sec"],
    )


def main() -> None:
    """`megalab-generate`: the Hydra entry point, with the closest keys after a misspelled one."""
    run_entry_point_of_a_run(hydra_main, "generate")


if __name__ == "__main__":
    main()
