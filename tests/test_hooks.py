"""The training loop's hooks run on their cadence: every N steps, at the last step, on a stop."""

import types

import pytest

from megatrain_jax.hooks import Hook, StepInfo


def steps_run(hook_args: dict, *, total: int, stop_at: int | None = None) -> list:
    """The steps 1..total after which Hook(**hook_args) ran, a stop signal arriving at stop_at."""
    ran = []
    signals = types.SimpleNamespace(received=None)
    hook = Hook(lambda info: ran.append(info.step), **hook_args)
    for step in range(1, total + 1):
        if step == stop_at:
            signals.received = "SIGTERM"
        hook(StepInfo(step=step, last=step == total, record={}, bad_steps=0, updates=step,
                      stop=signals))
        if signals.received:
            break
    return ran


@pytest.mark.parametrize("args, total, stop_at, expected", [
    (dict(), 4, None, [1, 2, 3, 4]),
    (dict(every=3), 7, None, [3, 6]),
    (dict(every=3, at_end=True), 7, None, [3, 6, 7]),
    (dict(every=3, at_end=True), 6, None, [3, 6]),  # the last step is a multiple: once
    (dict(every=0, at_end=True), 5, None, [5]),  # 0: no cadence, only the end
    (dict(every=0), 5, None, []),
    (dict(every=4, at_end=True, on_stop=True), 9, 6, [4, 6]),
    (dict(every=4, at_end=True), 9, 6, [4]),  # not on_stop: the stopped step is not the last
])
def test_a_hook_runs_every_n_steps_at_the_end_and_on_a_stop(args, total, stop_at, expected):
    assert steps_run(args, total=total, stop_at=stop_at) == expected
