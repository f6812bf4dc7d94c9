"""Rewards: verifiers, their composition, and a process-pool runtime that never hangs.

    from rljax.rewards import RewardSpec, RewardPool, make_reward_fn
    spec = RewardSpec.from_dict({"components": [{"name": "correct", "verifier": "math"}]})
    with RewardPool(spec) as pool:
      batch = pool.score(completions, examples, group_size=8)

See docs/rewards.md.
"""
from rljax.rewards import verifiers as _verifiers  # noqa: F401  (registers the built-ins)
from rljax.rewards.base import (
                                ItemFailure,
                                RewardResult,
                                Verifier,
                                get_verifier,
                                list_verifiers,
                                normalize_result,
                                register_verifier,
                                resolve,
)
from rljax.rewards.callback import RewardFn, make_reward_fn
from rljax.rewards.compose import RewardBatch, combine
from rljax.rewards.pool import RewardPool
from rljax.rewards.spec import ComponentSpec, RewardSpec, weight_at

__all__ = [
    "ComponentSpec", "ItemFailure", "RewardBatch", "RewardFn", "RewardPool", "RewardResult", "RewardSpec", "Verifier",
    "combine", "get_verifier", "list_verifiers", "make_reward_fn", "normalize_result", "register_verifier",
    "resolve", "weight_at",
]
