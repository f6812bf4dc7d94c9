"""The stages around RL on the same machinery (config.train.objective, docs/objectives.md):

    rl       the policy-gradient update on sampled, scored completions (the default)
    sft      supervised fine-tuning: cross-entropy on target responses from the data
    rft      rejection-sampling fine-tuning: sample G per prompt, score, keep the rows whose reward is at
             least rft.min_reward, cross-entropy on those (the RL loop with another loss and a row filter)
    distill  on-policy distillation: the student samples, a frozen teacher scores every sampled token by
             its log-prob in the same compiled step, the per-token reverse KL is the per-token advantage

This module imports nothing heavy (config validation reads it).
"""
from __future__ import annotations

OBJECTIVES = ("rl", "sft", "rft", "distill")
CE_OBJECTIVES = ("sft", "rft")          # cross-entropy on the (kept) target tokens, at temperature 1
SAMPLED_OBJECTIVES = ("rl", "rft", "distill")   # the step samples completions in-graph

__all__ = ["CE_OBJECTIVES", "OBJECTIVES", "SAMPLED_OBJECTIVES"]
