"""The authors' checkpoints and state dicts onto megalab modules: one module per model.

- `megalab.convert.mega`: facebookresearch/mega (fairseq) and the mega-image ImageNet model.
- `megalab.convert.common`: safe checkpoint loading and the time-first/padding-mask boundary.

Checkpoints are read with `torch.load(weights_only=True)` and an allow-list of the few
non-tensor objects the authors' files contain, so converting a downloaded file runs no code.
"""
