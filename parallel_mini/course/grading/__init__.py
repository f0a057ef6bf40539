"""Exercise graders: run the learner's function on real ranks and compare it with the library's.

Each `check_*` returns a Grade. A stub that still raises NotImplementedError is "not attempted"
(shown, not raised, so the learner's notebook runs top to bottom); a wrong answer raises an
AssertionError that says what was observed; a right one returns the measured run so the lesson can
draw the learner's own result (e.g. animate their ring).

While the learner's code runs, the library's own implementation of the same thing is disabled (its
functions' code swapped for a raiser that says so), so an answer that calls it is refused. The
ranks of a check wait at most CHECK_PG_TIMEOUT seconds for each other: a _RankTrace records each
rank's calls in the learner's code (or, where the learner's function runs inside the library's
code, as lessons 06 and 07's merge and route do, in that code and whether the rank was in the
learner's function), so a deadlock is reported as who waited in which call, not as gloo's text.
`compare_prediction` prints a lesson's prediction cell against what the live cell got.

What the checks cannot be fooled by (issue 21): the bytes each rank really wrote to its sockets
while the learner's code ran are measured and must be explained by the calls recorded through
`comm` (a collective called on the process group behind it, with a decoy through comm, is
refused: lessons 01-04); a function that is the library's own (its code object, a copy of its
bytecode, its source pasted in) is refused before anything runs; the expected answer is computed
after the learner's function returns or in another process, so no frame the learner's code can
read holds it; the in-process checks add cases drawn anew every check and stop an answer that does
not return within 10 s (ANSWER_TIMEOUT).

One module per lesson, to read beside it; every public name is imported here, so lessons and
tests write `from parallel_mini.course.grading import check_...`:

    core                      what every checker shares: Grade, _on_ranks, _RankTrace (deadlocks
                              explained, bytes explained), _CodeSwapped (the library's own
                              version disabled), _wire_verdict (bytes written against bytes
                              recorded), _library_copy, _call_in_time (10 s for an answer)
    lesson01_ring             01_collectives          check_ring_all_reduce
    lesson02_data_parallel    02_data_parallel        check_average_gradients,
                                                      check_bucketed_grad_sync
    lesson03_zero             03_memory_and_zero      check_zero1_step
    lesson04_tensor_parallel  04_tensor_parallel      check_parallel_mlp
    lesson05_pipeline         05_pipeline             check_one_f_one_b
    lesson06_merge            06_long_sequences       check_merge
    lesson07_route            07_mixture_of_experts   check_route
    lesson08_09_layouts       08_putting_it_together  check_states_per_rank
                              09_choosing_a_layout    check_layout_choice (and layout_candidates,
                                                      layout_config, planned_states)
    lesson10_barrier          10_without_a_barrier    check_server_average
    predictions               01-05, 08, 09           compare_prediction
"""
from __future__ import annotations

from .core import CHECK_PG_TIMEOUT, CHECK_RUN_TIMEOUT, Grade
from .lesson01_ring import check_ring_all_reduce
from .lesson02_data_parallel import (BUCKETED_CHECK, check_average_gradients,
                                     check_bucketed_grad_sync)
from .lesson03_zero import ZERO1_CHECK_SHAPE, check_zero1_step
from .lesson04_tensor_parallel import PARALLEL_MLP_SHAPE, PARALLEL_MLP_TOLERANCE, check_parallel_mlp
from .lesson05_pipeline import check_one_f_one_b
from .lesson06_merge import MERGE_CHECK_CASES, MERGE_CHECK_SHAPE, MERGE_TOLERANCE, check_merge
from .lesson07_route import (CAPACITY_CASES, ROUTE_RUN_CASES, ROUTE_RUN_COMMON, ROUTE_TOLERANCE,
                             check_route)
from .lesson08_09_layouts import (LAYOUT_BUDGETS, LAYOUT_LIVE_BUDGETS, LAYOUT_MODEL, LAYOUT_RANKS,
                                  STATES_CASES, STATES_LIVE, check_layout_choice,
                                  check_states_per_rank, layout_candidates, layout_config,
                                  planned_states)
from .lesson10_barrier import (SERVER_AVERAGE_CASES, SERVER_AVERAGE_COMMON,
                               SERVER_AVERAGE_TOLERANCE, check_server_average)
from .predictions import compare_prediction

__all__ = [
    "CHECK_PG_TIMEOUT", "CHECK_RUN_TIMEOUT", "Grade", "check_ring_all_reduce", "BUCKETED_CHECK",
    "check_average_gradients", "check_bucketed_grad_sync", "ZERO1_CHECK_SHAPE", "check_zero1_step",
    "PARALLEL_MLP_SHAPE", "PARALLEL_MLP_TOLERANCE", "check_parallel_mlp", "check_one_f_one_b",
    "MERGE_CHECK_CASES", "MERGE_CHECK_SHAPE", "MERGE_TOLERANCE", "check_merge", "CAPACITY_CASES",
    "ROUTE_RUN_CASES", "ROUTE_RUN_COMMON", "ROUTE_TOLERANCE", "check_route", "LAYOUT_BUDGETS",
    "LAYOUT_LIVE_BUDGETS", "LAYOUT_MODEL", "LAYOUT_RANKS", "STATES_CASES", "STATES_LIVE",
    "check_layout_choice", "check_states_per_rank", "layout_candidates", "layout_config",
    "planned_states", "SERVER_AVERAGE_CASES", "SERVER_AVERAGE_COMMON", "SERVER_AVERAGE_TOLERANCE",
    "check_server_average", "compare_prediction",
]
