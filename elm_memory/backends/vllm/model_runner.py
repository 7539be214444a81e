"""Which vLLM model runner an engine gets, and so where the ``stop_at_answer`` cut happens.

Our stop-at-answer logits processor (:mod:`elm_memory.backends.vllm.logits_processor`) is
written for vLLM's V1 model runner; the V2 runner (the default on GPUs) refuses it at
start-up. So an engine gets the processor only where vLLM's own engine config
(``VllmConfig.use_v2_model_runner``) says V1 will run: the answer is then ended inside the
engine, which only saves time. Otherwise the engine runs on to EOS or ``max_tokens`` and the
answer cut after generation (:func:`elm_memory.backends.postprocess.finish_generation`) gives
the same result. The decision is read from the same arguments the engine is started with:
``vllm.LLM`` keyword arguments offline, the command line for a server (there in the server's
own Python, see :mod:`elm_memory.backends.vllm.probe`). Nothing here imports vllm at import time.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

LOGITS_PROCESSOR = "elm_memory.backends.vllm.logits_processor:StopAtAnswerLogitsProcessor"
#: ``SamplingParams.extra_args`` key (server: ``vllm_xargs``) that turns the processor on for a
#: request; its value is the token id to end with (an EOS id).
STOP_XARG = "elm_stop_at_answer"

_logged_paths: set[str] = set()  # each path is logged once per process, not once per engine


def v2_runner_from_engine_config(config: Any) -> bool:
    """Whether an engine built from this ``VllmConfig`` runs vLLM's V2 model runner. vLLM
    releases from before the V2 runner have no such property: they run V1."""
    return bool(getattr(config, "use_v2_model_runner", False))


def uses_v2_model_runner(engine_kwargs: dict[str, Any]) -> bool:
    """vLLM's own runner decision for ``vllm.LLM(**engine_kwargs)``: the engine config is built
    from the same arguments (as ``LLM`` does, minus the logits processors) and its
    ``use_v2_model_runner`` read -- the property the engine's workers use."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    args = {k: v for k, v in engine_kwargs.items() if k in fields and k != "logits_processors"}
    return v2_runner_from_engine_config(EngineArgs(**args).create_engine_config())


def server_uses_v2_model_runner(argv: list[str]) -> bool:
    """vLLM's runner decision for a server started with the engine flags in ``argv`` (other
    flags are ignored): the engine config is built from them and ``use_v2_model_runner`` read."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM releases before the utils split
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef,unused-ignore]
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args, _ = parser.parse_known_args(argv)
    args.logits_processors = None  # the decision is made without ours, as the offline check does
    return v2_runner_from_engine_config(AsyncEngineArgs.from_cli_args(args).create_engine_config())


def select_stop_processor(engine_kwargs: dict[str, Any], detect: Any = uses_v2_model_runner) -> bool:
    """Add the stop-at-answer logits processor to ``engine_kwargs`` only where the engine will run
    it (V1 model runner); returns whether it was added. Without it the answer cut happens after
    generation only (same results). ``detect(engine_kwargs) -> bool`` says whether V2 is used;
    if it fails, the processor is left out (correct on either runner). Logs the path once."""
    try:
        use = not detect(engine_kwargs)
        why = "V1 model runner" if use else "vLLM's V2 model runner takes no V1-interface logits processor"
    except Exception as exc:  # noqa: BLE001 (any failure means: runner unknown)
        use, why = False, f"model runner unknown ({type(exc).__name__}: {str(exc)[:200]})"
    # A caller's own processors (engine_kwargs) stay; ours is added only for the V1 runner.
    others = [p for p in engine_kwargs.get("logits_processors") or () if p != LOGITS_PROCESSOR]
    if use or others:
        engine_kwargs["logits_processors"] = [*others, LOGITS_PROCESSOR] if use else others
    else:
        engine_kwargs.pop("logits_processors", None)
    path = stop_path(use)
    if path not in _logged_paths:
        _logged_paths.add(path)
        logger.info("vllm stop_at_answer: %s (%s)", path, why)
    return use


def stop_path(in_engine: bool) -> str:
    """Where answers are ended, in words for the logs."""
    return "in-engine logits processor + post-processing" if in_engine else "post-processing only"
