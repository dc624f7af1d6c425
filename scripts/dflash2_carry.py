"""A DFlash2 drafter trained for the embedded target, carried to the device as its difference from
the shipped DFlash drafter's function-preserving DFlash2 carry (`dflash2_from_dflash`, noise 0).
A selector-only run of scripts/train_reference_dflash2.sh changes only the selector's three tensors
(2 MB of the drafter's 16 MB), and the device's working tree is capped at 64 MiB with the repository
already ~50 MB of it.

  python3 scripts/dflash2_carry.py pack DRAFTER_DIR CARRY_DIR     # here: CARRY_DIR/{config.json,delta.safetensors}
  python3 scripts/dflash2_carry.py unpack CARRY_DIR OUT_DIR       # there: the drafter, tensor for tensor

`unpack` rebuilds the carry from the checkout's embedded pair, so both ends need the same shipped
drafter; each side checks the config it builds against the carried one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

from ddtree.assets import default_model_paths
from ddtree.models.configs import DrafterConfig
from ddtree.tools.train.selector import dflash2_from_dflash


def _weights(d: str) -> dict[str, torch.Tensor]:
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(d, f)))
    return out


def _base(config_path: str, out_dir: str) -> dict[str, torch.Tensor]:
    """The function-preserving carry at the drafter's selector rank and dtype; refuses a config
    that differs from it in anything else."""
    cfg = DrafterConfig.from_path(os.path.dirname(config_path))
    target, dflash = default_model_paths()
    dflash2_from_dflash(
        dflash,
        target,
        out_dir,
        selector_rank=cfg.selector_rank,
        dtype=getattr(torch, cfg.dtype),
    )
    want, got = json.load(open(config_path)), json.load(open(os.path.join(out_dir, "config.json")))
    diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    if diff:
        raise SystemExit(
            f"error: {config_path} differs from the embedded DFlash drafter's DFlash2 carry in "
            f"{diff}: not a drafter trained from it (scripts/train_reference_dflash2.sh)"
        )
    return _weights(out_dir)


def pack(drafter_dir: str, carry_dir: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = _base(os.path.join(drafter_dir, "config.json"), tmp)
    trained = _weights(drafter_dir)
    if set(trained) != set(base):
        raise SystemExit(f"error: {drafter_dir}'s tensor names differ from the carry's")
    delta = {k: v.contiguous() for k, v in trained.items() if not torch.equal(v, base[k])}
    os.makedirs(carry_dir, exist_ok=True)
    save_file(delta, os.path.join(carry_dir, "delta.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(
        os.path.join(drafter_dir, "config.json"), os.path.join(carry_dir, "config.json")
    )
    mb = sum(v.numel() * v.element_size() for v in delta.values()) / 2**20
    print(f"packed {len(delta)} of {len(trained)} tensors ({mb:.1f} MiB) into {carry_dir}")


def unpack(carry_dir: str, out_dir: str) -> None:
    base = _base(os.path.join(carry_dir, "config.json"), out_dir)
    delta = load_file(os.path.join(carry_dir, "delta.safetensors"))
    unknown = sorted(set(delta) - set(base))
    if unknown:
        raise SystemExit(f"error: the carry holds tensors the drafter lacks: {unknown[:5]}")
    for k in os.listdir(out_dir):
        if k.endswith(".safetensors") or k.endswith(".index.json"):
            os.remove(os.path.join(out_dir, k))
    base.update(delta)
    save_file(base, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    print(f"unpacked {out_dir}: {len(delta)} tensors from the carry")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", allow_abbrev=False)
    a.add_argument("drafter_dir")
    a.add_argument("carry_dir")
    b = sub.add_parser("unpack", allow_abbrev=False)
    b.add_argument("carry_dir")
    b.add_argument("out_dir")
    ns = p.parse_args(argv)
    if ns.cmd == "pack":
        pack(ns.drafter_dir, ns.carry_dir)
    else:
        unpack(ns.carry_dir, ns.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
