"""Generation backends: where completions (with or without a memory's soft prompt) are decoded.

* :mod:`~elm_memory.backends.base` -- the ``GenerationBackend`` protocol, prompts, sampling parameters;
* :mod:`~elm_memory.backends.hf` -- transformers (``hf``), with its decoding loop in :mod:`~elm_memory.backends.decode`;
* :mod:`~elm_memory.backends.vllm` -- vLLM through prompt embeddings (``vllm``, ``vllm-server``);
* :mod:`~elm_memory.backends.postprocess` -- EOS ids, finish reason and answer cut, shared by all of them.

Backends are picked by ``backend.name`` through :data:`elm_memory.backends.registry.backends`.
"""
