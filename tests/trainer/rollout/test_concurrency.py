"""The rollout worker's concurrency limits (docs/pipeline.md): the adaptive cap and the token allowance (both rules)."""

from __future__ import annotations

import asyncio

import pytest

from trainer.rollout.concurrency import PACKING_RATIO_STEPS, AdaptiveCap, StalenessAllowance, TokenAllowance
from trainer.vllm.prometheus import ServerLoad

IDLE = ServerLoad(kv_cache_usage=0.3, running=1, waiting=0, preemptions=0)
BUSY = ServerLoad(kv_cache_usage=0.9, running=8, waiting=0, preemptions=0)


def load(kv: float, waiting: float = 0) -> ServerLoad:
    return ServerLoad(kv_cache_usage=kv, running=1, waiting=waiting, preemptions=0)


async def finish(cap: AdaptiveCap, n: int) -> None:
    """Run ``n`` rollouts through the gate, one after the other."""
    for _ in range(n):
        await cap.acquire()
        await cap.release()


# --- AdaptiveCap: start and adjustments ----------------------------------------------------------

@pytest.mark.parametrize(("ceiling", "kv", "max_model_len", "start"), [
    (512, 10_000, 1000, 10),        # kv tokens / max_model_len
    (512, 10_999, 1000, 10),        # whole rollouts
    (8, 10_000, 1000, 8),           # clamped to the ceiling
    (512, 500, 1000, 1),            # at least one
    (512, None, 1000, 512),         # no /metrics: the ceiling
    (3, None, 1000, 3),
])
def test_cap_start(ceiling, kv, max_model_len, start):
    cap = AdaptiveCap(ceiling, kv, max_model_len)
    assert cap.limit == start
    assert cap.adaptive is (kv is not None)


def test_cap_without_metrics_never_moves():
    cap = AdaptiveCap(16, None, 1000)

    async def scenario():
        await finish(cap, 100)
        await cap.observe(IDLE)
        await cap.observe(BUSY)
        await cap.observe(None)

    asyncio.run(scenario())
    assert cap.limit == 16


def test_cap_grows_at_most_once_per_caps_worth_of_finished_rollouts():
    cap = AdaptiveCap(512, 10_000, 1000)  # starts at 10

    async def scenario() -> list[float]:
        caps = []
        await cap.observe(IDLE)  # nothing finished yet: no growth
        caps.append(cap.cap)
        await finish(cap, 9)
        await cap.observe(IDLE)  # 9 < 10 finished
        caps.append(cap.cap)
        await finish(cap, 1)
        await cap.observe(IDLE)  # 10 finished: grow x1.25
        caps.append(cap.cap)
        await cap.observe(IDLE)  # no rollout finished since the growth
        caps.append(cap.cap)
        await finish(cap, 11)
        await cap.observe(IDLE)  # 11 < limit 12
        caps.append(cap.cap)
        await finish(cap, 1)
        await cap.observe(IDLE)  # 12 finished since the last growth
        caps.append(cap.cap)
        return caps

    assert asyncio.run(scenario()) == pytest.approx([10, 10, 12.5, 12.5, 12.5, 15.625])
    assert cap.limit == 15


@pytest.mark.parametrize("reading", [
    load(0.3, waiting=1),    # something waits on the server
    load(0.6),               # not below 60 %
    load(0.75),              # between the thresholds: hold
    load(0.8),               # not above 80 %
    None,                    # no reading
])
def test_cap_holds(reading):
    cap = AdaptiveCap(512, 10_000, 1000)

    async def scenario():
        await finish(cap, 50)
        await cap.observe(reading)

    asyncio.run(scenario())
    assert cap.cap == 10


def test_cap_growth_clamped_to_ceiling():
    cap = AdaptiveCap(11, 10_000, 1000)

    async def scenario():
        await finish(cap, 10)
        await cap.observe(IDLE)
        await finish(cap, 20)
        await cap.observe(IDLE)

    asyncio.run(scenario())
    assert cap.cap == 11 and cap.limit == 11


def test_cap_shrinks_above_80_percent_without_waiting_for_rollouts():
    cap = AdaptiveCap(512, 10_000, 1000)

    async def scenario() -> list[int]:
        limits = []
        for _ in range(3):
            await cap.observe(BUSY)
            limits.append(cap.limit)
        return limits

    assert asyncio.run(scenario()) == [7, 4, 3]  # 10 -> 7 -> 4.9 -> 3.43
    assert cap.cap == pytest.approx(10 * 0.7**3)


def test_cap_shrink_floor_is_one():
    cap = AdaptiveCap(512, 2000, 1000)

    async def scenario():
        for _ in range(5):
            await cap.observe(BUSY)

    asyncio.run(scenario())
    assert cap.cap == 1.0 and cap.limit == 1


# --- AdaptiveCap: the gate -----------------------------------------------------------------------

async def blocked(coro, timeout: float = 0.05) -> bool:
    """True when ``coro`` does not finish within ``timeout`` (it is cancelled)."""
    try:
        await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        return True
    return False


def test_acquire_blocks_at_the_limit_and_release_wakes_it():
    async def scenario():
        cap = AdaptiveCap(2, None, 1000)
        await asyncio.wait_for(cap.acquire(), 5)
        await asyncio.wait_for(cap.acquire(), 5)
        assert cap.in_flight == 2
        assert await blocked(cap.acquire())
        assert cap.in_flight == 2  # the cancelled waiter took nothing

        waiter = asyncio.create_task(cap.acquire())
        await asyncio.sleep(0.02)
        assert not waiter.done()
        await cap.release()
        await asyncio.wait_for(waiter, 5)
        assert cap.in_flight == 2 and cap.finished == 1

    asyncio.run(scenario())


def test_shrink_keeps_running_rollouts_and_holds_new_ones():
    async def scenario():
        cap = AdaptiveCap(4, 4000, 1000)  # starts at 4
        for _ in range(4):
            await cap.acquire()
        await cap.observe(BUSY)  # 4 -> 2.8: the 4 running continue
        await cap.observe(BUSY)  # -> 1.96: limit 1
        assert cap.limit == 1 and cap.in_flight == 4
        waiter = asyncio.create_task(cap.acquire())
        for in_flight in (3, 2, 1):
            await cap.release()
            await asyncio.sleep(0.01)
            assert not waiter.done(), f"admitted with {in_flight} in flight over a limit of 1"
        await cap.release()
        await asyncio.wait_for(waiter, 5)
        assert cap.in_flight == 1

    asyncio.run(scenario())


def test_growth_wakes_a_waiter():
    async def scenario():
        cap = AdaptiveCap(512, 1000, 1000)  # starts at 1
        for _ in range(3):                  # 1 -> 1.25 -> 1.5625 -> 1.95: still a limit of 1
            await finish(cap, 1)
            await cap.observe(IDLE)
        assert cap.limit == 1
        await finish(cap, 1)                # a cap's worth finished: the next idle reading grows it
        await cap.acquire()
        waiter = asyncio.create_task(cap.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await cap.observe(IDLE)             # -> 2.44: a limit of 2 admits the waiter
        await asyncio.wait_for(waiter, 5)
        assert cap.limit == 2 and cap.in_flight == 2

    asyncio.run(scenario())


def test_many_concurrent_rollouts_never_exceed_the_limit():
    async def scenario() -> int:
        cap = AdaptiveCap(3, None, 1000)
        peak = 0

        async def rollout():
            nonlocal peak
            await cap.acquire()
            peak = max(peak, cap.in_flight)
            await asyncio.sleep(0.005)
            await cap.release()

        await asyncio.wait_for(asyncio.gather(*(rollout() for _ in range(30))), 5)
        assert cap.in_flight == 0 and cap.finished == 30
        return peak

    assert asyncio.run(scenario()) == 3


# --- TokenAllowance ------------------------------------------------------------------------------

def test_allowance_one_group_at_a_time_until_the_first_finishes():
    allowance = TokenAllowance()
    assert allowance.mean_group_tokens is None
    assert allowance.may_start(allowance=10**9, consumed=0)
    allowance.started()
    assert not allowance.may_start(allowance=10**9, consumed=0)
    allowance.finished(tokens_queued=100, tokens_generated_total=100)
    assert allowance.mean_group_tokens == 100
    assert allowance.may_start(allowance=10**9, consumed=0)


def started_and_finished(groups: list[tuple[int, int]]) -> TokenAllowance:
    allowance = TokenAllowance()
    for queued, total in groups:
        allowance.started()
        allowance.finished(tokens_queued=queued, tokens_generated_total=total)
    return allowance


@pytest.mark.parametrize(("in_flight", "consumed", "budget", "expected"), [
    # queued 200 (produced) - consumed; estimate 100 per group
    (0, 0, 300, True),       # 200 queued + 1 x 100 <= 300
    (0, 0, 299, False),
    (1, 0, 400, True),       # 200 + 2 x 100
    (1, 0, 399, False),
    (2, 150, 350, True),     # 50 + 3 x 100
    (2, 150, 349, False),
    (1, 200, 200, True),     # nothing queued: 2 x 100
    (1, 200, 199, False),    # something in flight: the allowance holds
    (0, 200, 0, True),       # nothing queued or in flight: never starve
    (0, 500, 0, True),       # consumed beyond produced counts as nothing queued
    (0, 199, 0, False),      # 1 token still queued
])
def test_allowance_after_first_group(in_flight, consumed, budget, expected):
    allowance = started_and_finished([(100, 100), (100, 100)])
    for _ in range(in_flight):
        allowance.started()
    assert allowance.may_start(allowance=budget, consumed=consumed) is expected


def test_allowance_estimate_is_mean_group_size_and_dropped_groups_queue_nothing():
    allowance = started_and_finished([(0, 300), (100, 100)])  # the first group was dropped
    assert allowance.mean_group_tokens == 200
    assert allowance.produced == 100
    assert allowance.groups_in_flight == 0
    assert allowance.may_start(allowance=300, consumed=0)      # 100 + 200
    assert not allowance.may_start(allowance=299, consumed=0)


def test_allowance_loop_keeps_queue_within_allowance():
    """A worker that starts groups whenever allowed never holds more than the allowance."""
    allowance = started_and_finished([(100, 100)])
    consumed, budget = 0, 1000
    for step in range(20):
        while allowance.may_start(allowance=budget, consumed=consumed):
            allowance.started()
            held = allowance.produced - consumed + allowance.groups_in_flight * 100
            assert held <= budget or (allowance.groups_in_flight == 1 and allowance.produced == consumed)
        assert allowance.groups_in_flight > 0, f"step {step}: starved"
        while allowance.groups_in_flight:
            allowance.finished(tokens_queued=100, tokens_generated_total=100)
        consumed += 400  # the trainer takes 4 groups a step
        consumed = min(consumed, allowance.produced)


def test_room_counts_slots_promised_to_started_groups():
    async def scenario():
        cap = AdaptiveCap(4, None, 1000)
        await asyncio.wait_for(cap.wait_for_room(), 5)
        cap.reserve(3)                          # a group of 3 started; none has a slot yet
        await asyncio.wait_for(cap.wait_for_room(), 5)  # 3 promised < 4
        cap.reserve(3)                          # a second group: 6 promised
        assert await blocked(cap.wait_for_room())
        for _ in range(4):                      # four of them get a slot
            await asyncio.wait_for(cap.acquire(reserved=True), 5)
        assert cap.in_flight == 4 and cap.reserved == 2
        room = asyncio.create_task(cap.wait_for_room())
        for _ in range(2):                      # the last two take the slots two finished rollouts free
            await cap.release()
            await asyncio.wait_for(cap.acquire(reserved=True), 5)
        await asyncio.sleep(0.01)
        assert not room.done(), "room reported while every slot is taken"
        await cap.release()
        await asyncio.wait_for(room, 5)
        assert cap.in_flight == 3 and cap.reserved == 0

    asyncio.run(scenario())


# --- AdaptiveCap: time-weighted in-flight count (rollout/concurrency) ----------------------------

class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_mean_in_flight_is_time_weighted_per_window():
    clock = FakeClock()
    cap = AdaptiveCap(8, None, 1000, clock=clock)

    async def scenario() -> list[float]:
        await cap.acquire()          # t=0: 1 in flight
        clock.now = 2.0
        await cap.acquire()          # t=2: 2
        clock.now = 3.0
        await cap.release()          # t=3: 1
        clock.now = 4.0
        first = cap.take_mean_in_flight()   # (1*2 + 2*1 + 1*1) / 4
        clock.now = 6.0
        second = cap.take_mean_in_flight()  # 1 throughout
        await cap.release()
        third = cap.take_mean_in_flight()   # an empty window: the current count
        return [first, second, third]

    assert asyncio.run(scenario()) == pytest.approx([1.25, 1.0, 0.0])


def test_mean_in_flight_sees_a_stall_between_two_instants():
    """Full at both ends of the window, empty in between: an instantaneous reading would say 2."""
    clock = FakeClock()
    cap = AdaptiveCap(2, None, 1000, clock=clock)

    async def scenario() -> float:
        await cap.acquire()
        await cap.acquire()
        cap.take_mean_in_flight()
        clock.now = 1.0
        await cap.release()
        await cap.release()
        clock.now = 9.0
        await cap.acquire()
        await cap.acquire()
        clock.now = 10.0
        return cap.take_mean_in_flight()

    assert asyncio.run(scenario()) == pytest.approx((2 * 1 + 0 * 8 + 2 * 1) / 10)


# --- StalenessAllowance: the trainer's side of the allowance ------------------------------------

@pytest.mark.parametrize(("max_staleness", "consumed_steps", "capacity_steps"), [
    (4, 4, 3), (2, 2, 1), (1, 1, 1), (0, 1, 1),
])
def test_allowance_rules_steps_ahead(max_staleness, consumed_steps, capacity_steps):
    consumed = StalenessAllowance("consumed", max_staleness, step_capacity=1000)
    capacity = StalenessAllowance("capacity", max_staleness, step_capacity=1000)
    assert (consumed.initial, capacity.initial) == (consumed_steps * 1000, capacity_steps * 1000)


def test_consumed_rule_follows_the_last_step_consumption():
    rule = StalenessAllowance("consumed", 4, step_capacity=1000)
    assert rule.after_step(consumed=11_000, packed=11_000, forwarded=1000) == 44_000
    assert rule.after_step(consumed=200, packed=200, forwarded=20) == 800  # a short queue shrinks it


def test_capacity_rule_counts_a_full_step_in_sample_tokens():
    """A row of 1,000 forwarded tokens packs 11,000 sample tokens: a full step takes 11x its capacity,
    and a step that took little because little was queued does not shrink the allowance."""
    rule = StalenessAllowance("capacity", 4, step_capacity=1000)
    assert rule.after_step(consumed=11_000, packed=11_000, forwarded=1000) == 3 * 11_000
    assert rule.after_step(consumed=220, packed=220, forwarded=20) == 3 * 11_000
    assert rule.packing_ratio == pytest.approx(11.0)


def test_capacity_rule_ignores_stale_drops_and_follows_recent_packing():
    rule = StalenessAllowance("capacity", 4, step_capacity=1000)
    # 5,000 tokens taken off the queue, of which only 2,000 packed (the rest dropped as stale):
    # the ratio is of what was packed, so drops do not inflate the allowance.
    assert rule.after_step(consumed=5000, packed=2000, forwarded=1000) == 3 * 2000
    for _ in range(PACKING_RATIO_STEPS):  # the old step leaves the window
        allowance = rule.after_step(consumed=4000, packed=4000, forwarded=1000)
    assert allowance == 3 * 4000
    assert rule.after_step(consumed=10, packed=0, forwarded=0) == 3 * 4000  # an empty step changes nothing


def test_allowance_rule_is_checked():
    with pytest.raises(ValueError, match="'fast' is not one of"):
        StalenessAllowance("fast", 4, step_capacity=1000)  # type: ignore[arg-type]
