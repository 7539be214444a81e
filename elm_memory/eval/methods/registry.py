"""``elm stream --method NAME`` -> online evaluation method: ELM and the paper's baselines (plugins: the
entry-point group ``elm_memory.eval_methods``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from elm_memory.plugins import Registry

if TYPE_CHECKING:
    from elm_memory.eval.methods.base import EvalMethod, EvalRuntime

eval_methods: Registry[Callable[[EvalRuntime], EvalMethod]] = Registry("evaluation method", "elm_memory.eval_methods")
eval_methods.register("zero_shot", "elm_memory.eval.methods.baselines:ZeroShot")
eval_methods.register("verifier_at_2", "elm_memory.eval.methods.baselines:verifier_at_2")
eval_methods.register("icl", "elm_memory.eval.methods.text_memory:ICL")
eval_methods.register("reasoning_bank", "elm_memory.eval.methods.text_memory:ReasoningBank")
eval_methods.register("lag", "elm_memory.eval.methods.lag:lag")
eval_methods.register("lag_tts", "elm_memory.eval.methods.lag:lag_tts")
eval_methods.register("elm_input", "elm_memory.eval.methods.elm_method:elm_input")
eval_methods.register("elm_kv", "elm_memory.eval.methods.elm_method:elm_kv")
eval_methods.register("elm_kv_centered", "elm_memory.eval.methods.elm_method:elm_kv_centered")
eval_methods.register("elm_untrained", "elm_memory.eval.methods.elm_method:elm_untrained")
eval_methods.register("self_consistency", "elm_memory.eval.methods.voting:SelfConsistency")
eval_methods.register("maj_at_k", "elm_memory.eval.methods.voting:MajorityAtK")
eval_methods.register("elm_stream", "elm_memory.eval.methods.stream_method:elm_stream")
eval_methods.register("elm_stream_objectives", "elm_memory.eval.methods.stream_method:elm_stream_objectives")
eval_methods.register("elm_stream_sources", "elm_memory.eval.methods.stream_method:elm_stream_sources")
eval_methods.register("elm_stream_gold", "elm_memory.eval.methods.stream_method:elm_stream_gold")
eval_methods.register("zero_shot_format", "elm_memory.eval.methods.stream_method:zero_shot_format")
eval_methods.register("elm_amortized", "elm_memory.eval.methods.amortized_method:elm_amortized")
