"""Rollouts: what the student samples, from prompts or from games.

* :mod:`~opd.rollout.sampling` -- the batch (:class:`~opd.rollout.sampling.RolloutBatch`) and the
  default backend, sampling with the KV cache from a Hugging Face causal LM (top-p, seeded).
* :mod:`~opd.rollout.prompt_set` -- the prompt source: tasks' prompts, tokenized, visited in a seeded order.
* :mod:`~opd.rollout.episodes` -- multi-turn episodes: the student acts, the environment replies.
* :mod:`~opd.rollout.game_set` -- the game source: an environment's games and what a step logs of them.
"""
