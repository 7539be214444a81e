"""Memory creation: turn the compute spent on one question into a soft prompt.

- ``initialization.py`` the soft prompt's initialisation from the question's token embeddings
- ``rewards.py``  TTRL reward: 1 if a rollout's answer equals the group's majority answer
- ``losses.py``   Dr.GRPO / GRPO / BNPO policy loss with the k3 KL to the reference policy
- ``native.py``   the training loop (rollouts from any GenerationBackend, forward/backward in transformers)
- ``trl_engine.py`` the same training through TRL's GRPOTrainer + PEFT prompt tuning (reference/parity)
- ``engines.py``  the Trainer protocol and the engines by name (the ``training_engines`` registry)
- ``learn.py``    initialise, train with the configured engine, package the result as a LatentMemory
"""
