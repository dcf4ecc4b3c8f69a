"""The phases of a sweep's controller (sweep.controller)."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    NEXT_RUNG = "next_rung"  # between rungs: the next one is planned, or the sweep ends
    MEETING = "meeting"  # waiting for every rank at a boundary (then what waits on it runs)
    BUILDING = "building"  # the rung's chains are prefilling
    NEXT_POINT = "next_point"  # the rung is built: its next point starts, or it is shed
    CATCHING_UP = "catching_up"  # exact state: the point's catch-up chains are prefilling
    MEASURING = "measuring"  # the point's requests are queued, admitted and timed
    ENDING = "ending"  # the sweep waits for requests from outside before its leak check
    DONE = "done"
