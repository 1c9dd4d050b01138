"""Rollouts: what the student samples, from prompts or from games.

* :mod:`~opd.rollout.engine` -- the rollout-engine interface (:class:`~opd.rollout.engine.RolloutEngine`) and
  the batch (:class:`~opd.rollout.engine.RolloutBatch`); :mod:`~opd.rollout.registry` -- the engines by name.
* :mod:`~opd.rollout.sampling` -- the default engine, sampling with the KV cache from a Hugging Face
  causal LM (top-p, seeded); :mod:`~opd.rollout.served` -- the base of engines that answer whole
  requests, as :mod:`~opd.rollout.vllm_engine` (a vLLM server) does.
* :mod:`~opd.rollout.prompt_set` -- the prompt source: tasks' prompts, tokenized, visited in a seeded order.
* :mod:`~opd.rollout.episodes` -- multi-turn episodes: the student acts, the environment replies.
* :mod:`~opd.rollout.game_set` -- the game source: an environment's games and what a step logs of them.
"""
