"""A topic delete's lifecycle, as a table (``docs/operations.md``, *Deleting a topic*).

    (admin) 1 mark deleting --> STOP_SERVING
    STOP_SERVING      --step_done--> REMOVE_LOCAL_LOGS   2: fence every partition state
    REMOVE_LOCAL_LOGS --step_done--> REMOVE_SNAPSHOTS    3: every live replica has removed
    REMOVE_SNAPSHOTS  --step_done--> DELETE_OBJECTS      4: replay and Spark stop seeing it
    DELETE_OBJECTS    --batch_deleted--> DELETE_OBJECTS  5: one DeleteObjects batch done
    DELETE_OBJECTS    --step_done--> REMOVE_OFFSETS      5: no segment object is left
    REMOVE_OFFSETS    --step_done--> REMOVE_METADATA     6: no group has offsets for it
    REMOVE_METADATA   --step_done--> DONE                7: the topic node is gone
    any but DONE      --not_yet--> (same)                waiting for replicas, or a failure

The step a topic is in is stored with the topic (``TopicSpec.deletion``, compare-and-set on
the znode's version) and each step is idempotent, so whichever controller is elected next
resumes a delete where the last one stopped, however it stopped. A (step, event) pair missing
from ``TRANSITIONS`` is illegal: ``next_step`` raises ``IllegalTransitionError`` (a bug in
the deleter), and ``tests/test_topic_deletion_state.py`` walks every pair.
"""

from __future__ import annotations

import enum
import itertools

from broker_agents.groups.state import IllegalTransitionError
from storage.metadata.models import DeletionStep


class DeletionEvent(enum.StrEnum):
    STEP_DONE = "step_done"  # the step's work is complete
    BATCH_DELETED = "batch_deleted"  # step 5: one batch of segment objects is gone
    NOT_YET = "not_yet"  # the step cannot complete now (replicas still removing, a failure)


S, E = DeletionStep, DeletionEvent
ORDER = (
    S.STOP_SERVING,
    S.REMOVE_LOCAL_LOGS,
    S.REMOVE_SNAPSHOTS,
    S.DELETE_OBJECTS,
    S.REMOVE_OFFSETS,
    S.REMOVE_METADATA,
    S.DONE,
)

TRANSITIONS: dict[tuple[DeletionStep, DeletionEvent], DeletionStep] = {
    **{(step, E.STEP_DONE): after for step, after in itertools.pairwise(ORDER)},
    **{(step, E.NOT_YET): step for step in ORDER[:-1]},
    (S.DELETE_OBJECTS, E.BATCH_DELETED): S.DELETE_OBJECTS,
}


def next_step(step: DeletionStep, event: DeletionEvent) -> DeletionStep:
    try:
        return TRANSITIONS[(step, event)]
    except KeyError:
        raise IllegalTransitionError(
            f"topic deletion event {event.value} in step {step.value}"
        ) from None
