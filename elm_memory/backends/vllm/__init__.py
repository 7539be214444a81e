"""vLLM generation backends: memories (soft prompts) sent to vLLM as prompt embeddings.

Two backends, registered as ``vllm`` and ``vllm-server``:

* :mod:`~elm_memory.backends.vllm.engine` -- ``VLLMBackend``, an offline engine (``vllm.LLM``) in this process;
* :mod:`~elm_memory.backends.vllm.server_backend` -- ``VLLMServerBackend``, HTTP to an OpenAI-compatible
  server, through :mod:`~elm_memory.backends.vllm.client` (needs no vllm install here).

What they share: :mod:`~elm_memory.backends.vllm.common` (version floor, limits),
:mod:`~elm_memory.backends.vllm.model_side` (tokenizer, embedding table, ModelInfo without the
engine) and :mod:`~elm_memory.backends.vllm.model_runner` (V1 / V2 runner: where answers are
ended). :mod:`~elm_memory.backends.vllm.logits_processor` runs inside the engine;
:mod:`~elm_memory.backends.vllm.launcher` starts and stops a local server, asking its Python first
through :mod:`~elm_memory.backends.vllm.probe`.

Importing this package does not import vllm (only creating a ``VLLMBackend`` or loading the
logits processor does); inside it, ``import vllm`` is the third-party package (absolute imports).
"""

from elm_memory.backends.vllm.common import VLLMVersionError
from elm_memory.backends.vllm.engine import VLLMBackend
from elm_memory.backends.vllm.server_backend import VLLMServerBackend

__all__ = ["VLLMBackend", "VLLMServerBackend", "VLLMVersionError"]
