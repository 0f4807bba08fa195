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


def poisoned_tiny(dst, token: int, seed: int = 3):
    """A tiny llama checkpoint in new dir `dst` whose embedding row `token`
    is +inf: a lane fed that token gets a non-finite row from the model
    itself (a NUMERIC fault nothing injected): `dst`."""
    from pathlib import Path

    from superfluid.engine.tiny import write_tiny

    dst = Path(dst)
    src = dst.with_name(dst.name + ".clean")
    write_tiny(src, arch="llama", seed=seed, tokenizer=False)

    def poison(tensors):
        (name,) = [n for n in tensors if n.endswith("embed_tokens.weight")]
        tensors[name][token] = float("inf")

    return rewrite_checkpoint(src, dst, poison)


if __name__ == "__main__":  # python -m superfluid.testing.checkpoints poisoned DIR TOKEN (the Rust tests)
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "poisoned":
        sys.exit("usage: python -m superfluid.testing.checkpoints poisoned DIR TOKEN")
    print(poisoned_tiny(sys.argv[2], int(sys.argv[3])))
