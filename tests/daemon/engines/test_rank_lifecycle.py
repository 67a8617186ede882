"""A rank's lifecycle is one table (kvd.daemon.engines.table.RANK_TRANSITIONS), as a
pull's and a hold's are: every state has a row, FREED is final, and only `EngineRank.to`
assigns a state."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.daemon.engines import registry as registry_mod
from kvd.daemon.engines import table as T
from kvd.daemon.engines.table import RANK_TRANSITIONS, RankOn, RankState, next_rank_state
from kvd.daemon.transitions import BadTransition


def test_every_state_has_a_row_and_freed_is_final() -> None:
    assert set(RANK_TRANSITIONS) == set(RankState)
    assert RANK_TRANSITIONS[RankState.FREED] == {}
    # a pool is freed only through FREEING, and taken back only while DORMANT
    into_freed = {s for s, moves in RANK_TRANSITIONS.items() if RankState.FREED in moves.values()}
    assert into_freed == {RankState.FREEING, RankState.DORMANT}
    assert [s for s, m in RANK_TRANSITIONS.items() if RankOn.TAKEN_BACK in m] == [
        RankState.DORMANT]
    # a live rank only retires: nothing frees or keeps a pool a live rank serves
    assert RANK_TRANSITIONS[RankState.LIVE] == {RankOn.GONE: RankState.RETIRED}


@given(st.lists(st.sampled_from(list(RankOn)), max_size=20))
def test_only_the_table_moves_a_rank(events: list[RankOn]) -> None:
    state = RankState.LIVE
    for event in events:
        want = RANK_TRANSITIONS[state].get(event)
        if want is None:
            with pytest.raises(BadTransition):
                next_rank_state(state, event)
        else:
            state = next_rank_state(state, event)
            assert state is want


def test_only_the_rank_assigns_its_state() -> None:
    for mod in (T, registry_mod):
        src = inspect.getsource(mod)
        assert src.count(".state = ") == (1 if mod is T else 0)
    assert "self.state = next_rank_state(" in inspect.getsource(T.EngineRank)
