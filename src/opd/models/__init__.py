"""Models: loading local Hugging Face checkpoints with the checks OPD needs, the tokenizer opd
trains for its embedded default, and LoRA adapters.

* :mod:`~opd.models.loading` -- ``load_model``, ``load_tokenizer``, the head and hidden states.
* :mod:`~opd.models.tokenizer` -- the locally trained tokenizer of the demos.
* :mod:`~opd.models.lora` -- ``--lora-r``: a peft adapter, merged on demand.
* :mod:`~opd.models.sharding` -- FSDP over a model: a unit per block, computations inside the root's forward.
* :mod:`~opd.models.export` -- the weights a rollout engine is given (merged, gathered, the tied head; or the adapter).
* :mod:`~opd.runs.quiet` -- transformers' progress bars and deprecation notices off around opd's loads and saves.
"""
