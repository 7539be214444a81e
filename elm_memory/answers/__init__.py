r"""Math answers: extraction, equivalence and the majority vote whose agreement is the TTRL reward.

Model outputs are asked to "put your final answer within \boxed{}". One module a step:

* :mod:`~elm_memory.answers.extract`: a completion -> its answer string (:func:`extract_answer`),
  and whether a growing completion has closed its answer (:func:`is_answer_closed`);
* :mod:`~elm_memory.answers.normalize`: the canonical string form (the fast path);
* :mod:`~elm_memory.answers.symbolic`: math-verify under a deadline, safe from any thread;
* :mod:`~elm_memory.answers.equivalence`: :func:`equivalent`, the two above combined;
* :mod:`~elm_memory.answers.vote`: :func:`majority_vote` and :func:`majority_rewards` (training), and
  ``plurality_vote``, the self-consistency rule the baselines and the ``vote`` route share.
"""

from elm_memory.answers.equivalence import equivalent
from elm_memory.answers.extract import Fallback, extract_answer, is_answer_closed
from elm_memory.answers.vote import Vote, majority_rewards, majority_vote

__all__ = [
    "Fallback",
    "Vote",
    "equivalent",
    "extract_answer",
    "is_answer_closed",
    "majority_rewards",
    "majority_vote",
]
