"""Online evaluation methods: ELM and the paper's baselines, picked by name.

``elm stream --method NAME`` looks names up in :data:`elm_memory.eval.methods.registry.eval_methods`;
third parties add one through the ``elm_memory.eval_methods`` entry-point group with a
factory ``factory(runtime: EvalRuntime) -> EvalMethod``.
"""

from elm_memory.eval.methods.base import EvalMethod, EvalRuntime, MethodOutput, build_method

__all__ = ["EvalMethod", "EvalRuntime", "MethodOutput", "build_method"]
