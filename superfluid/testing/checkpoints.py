"""Checkpoints for tests: copies of a saved one with its tensors edited."""

from __future__ import annotations

from safetensors.torch import load_file, save_file


def rewrite_checkpoint(src, dst, edit):
    """Copy checkpoint dir `src` to new dir `dst` with `edit` applied to its tensors (a dict): `dst`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst
