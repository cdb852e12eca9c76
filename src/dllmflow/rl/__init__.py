"""Reinforcement learning for diffusion LMs: GRPO with verifiable rewards (docs/strategies.md §8).

    estimators.py  sequence log-likelihood estimators for absorbing-mask dLLMs (one_step, mc_elbo, coupled)
    objective.py   group-normalised advantages and the clipped GRPO loss with a k3 KL to the reference
    rewards.py     exact-match / format rewards, user rewards named "module:attr", scoring with failures

Sits above training, the samplers and evaluation (it reuses the Trainer and the answer parser).
"""
