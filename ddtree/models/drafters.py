"""The drafter registry: `architectures[0]` of a drafter's config.json -> its module class, imported
lazily (no import cycle: the drafter modules import nothing of this one). Every class implements
the interface `DFlashDrafter` documents (`context_kv`, `block_hidden`, `logits`, `propose`,
`proposal_logits`, `build_tree`, `forward_train`), so the engine, the graphs and the tools never ask
which one they hold."""

from __future__ import annotations

import importlib

from ddtree.models.configs import ConfigError, DrafterConfig

DRAFTERS = {
    "DFlashDraftModel": ("ddtree.models.dflash", "DFlashDrafter"),
    "DFlash2DraftModel": ("ddtree.models.dflash2", "DFlash2Drafter"),
}


def drafter_class(cfg: DrafterConfig):
    """The module class for `cfg`; a config `DrafterConfig.problems` refuses raises ConfigError
    naming the field (before any weight is read)."""
    bad = cfg.problems()
    if bad:
        raise ConfigError(bad)
    module, name = DRAFTERS[cfg.architecture]
    return getattr(importlib.import_module(module), name)


def build_drafter(cfg: DrafterConfig, tp=None, **options):
    """`options`: the class's own constructor arguments (DFlash2's `tree`)."""
    return drafter_class(cfg)(cfg, tp, **options)
