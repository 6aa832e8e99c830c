"""Activations: every byte a training step's activations hold, as one package.

- ``profile.py``: the activation profile the engine reads (traced, or the analytic cross-check) and the
  recompute policies; its names are this package's (``from memplan.activations import TracedProfile``);
- ``tracing/``: one training micro-step of the real module on fake tensors, followed op by op (torch imported
  only here);
- ``kernels.py``: the device's kernel rules without torch (which SDPA backend runs, what it saves, GEMM and
  reduction scratch); ``substitutes.py`` and ``substitutes_sdpa.py`` make the fake-tensor step run them;
- ``profile_cache.py``: the shipped profiles and the user's cache; ``profile_fit.py``: envelopes rebuilt, and a
  profile at an untraced sequence length; ``tracing_keys.py``: the dtype setup each recipe is traced in.

Importing this package imports profile.py only (no torch): ``memplan estimate <preset>`` stays fast.
"""

from memplan.activations.profile import (ACTIVATION_SOURCES, ATTENTION, EVERY, INSIDE_LAST_BLOCK_FORWARD, LAYER_SAC,
                                         OP_SAC, RECOMPUTE, ActivationProfile, HeldProfile, Terms, TracedProfile,
                                         analytic_profile, at_layers, cached_profile, checkpoint_every,
                                         checkpoint_offset, checkpointed_blocks, has_dropout, is_checkpointed,
                                         last_checkpointed, valid_recompute)

__all__ = ["ACTIVATION_SOURCES", "ATTENTION", "EVERY", "INSIDE_LAST_BLOCK_FORWARD", "LAYER_SAC", "OP_SAC", "RECOMPUTE",
           "ActivationProfile", "HeldProfile", "Terms", "TracedProfile", "analytic_profile", "at_layers",
           "cached_profile", "checkpoint_every", "checkpoint_offset", "checkpointed_blocks", "has_dropout",
           "is_checkpointed", "last_checkpointed", "valid_recompute"]
