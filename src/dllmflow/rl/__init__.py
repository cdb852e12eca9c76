"""Reinforcement learning for diffusion LMs: GRPO with verifiable rewards (docs/strategies.md §8).

    estimators.py  sequence log-likelihood estimators for absorbing-mask dLLMs (one_step, mc_elbo, coupled)
    objective.py   group-normalised advantages and the clipped GRPO loss with a k3 KL to the reference
    rewards.py     exact-match / format rewards, user rewards named "module:attr", scoring with failures
    prompts.py     the prompt set (a prepared split, asked as evaluation asks), seeded order per epoch
    rollout.py     G rollouts per prompt with the project's samplers, seeded per prompt; policy entropy
    trainer.py     GRPOTrainer: the Trainer with a GRPO step (checkpoints, resume, logging unchanged)
    main.py        the torchrun entry (`python -m dllmflow.rl --run-dir RUN`, settings in $DLLMFLOW_SETTINGS)

Sits above training, the samplers and evaluation (it reuses the Trainer and the answer parser).
"""
