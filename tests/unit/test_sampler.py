"""Distributed batching: every rank the same number of micro-batches, every sample once, budgets kept."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddptrain.config import Batching
from ddptrain.data.batch_cost import round_up
from ddptrain.data.plan import BatchingSpec, micro_batch_cost, plan_epoch
from ddptrain.data.sampler import DistributedBatchSampler, Layout

FIXED_ROWS = (Batching.random, Batching.length_grouped)
PROPERTY_SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_lengths(kind: str, n: int, seed: int, max_length: int) -> np.ndarray:
    """Synthetic token lengths: uniform, skewed (heavy right tail like instruction data) or all equal."""
    rng = np.random.default_rng(seed)
    if kind == "equal":
        return np.full(n, max(1, max_length // 2), dtype=np.int64)
    if kind == "skewed":
        return np.clip(rng.lognormal(np.log(max_length / 6), 0.8, n).astype(np.int64), 1, max_length)
    return rng.integers(1, max_length + 1, n)


@st.composite
def cases(draw, min_samples: int = 1):
    """A (lengths, spec) pair with enough data for at least one micro-step."""
    mode = draw(st.sampled_from(list(Batching)))
    world = draw(st.integers(1, 8))
    rows = draw(st.integers(1, 6))
    pad = draw(st.sampled_from([1, 8]))
    max_length = draw(st.integers(1, 300))
    need = world * rows if mode in FIXED_ROWS else world
    n = draw(st.integers(max(need, min_samples), max(need, min_samples) + 400))
    lengths = make_lengths(
        draw(st.sampled_from(["uniform", "skewed", "equal"])), n, draw(st.integers(0, 2**16)), max_length
    )
    budget = round_up(int(lengths.max()), pad) * draw(st.integers(1, 6)) + draw(st.integers(0, 50))
    spec = BatchingSpec(
        mode=mode,
        world_size=world,
        micro_batch_size=rows,
        max_tokens_per_batch=budget,
        grad_accum_steps=draw(st.sampled_from([1, 2, 4])),
        pad_to_multiple_of=pad,
        seed=draw(st.integers(0, 2**31 - 1)),
        costliest_first=draw(st.booleans()),
    )
    return lengths, spec


def used_indices(plan) -> list[int]:
    return [i for step in plan for batch in step for row in batch for i in row]


def check_plan(plan, lengths: np.ndarray, spec: BatchingSpec) -> None:
    """Shape, exactly-once coverage, the documented tail, and the token budget."""
    assert plan, "at least one micro-step"
    for step in plan:
        assert len(step) == spec.world_size
        for batch in step:
            assert batch and all(row for row in batch)
            if spec.mode is Batching.packed:
                assert len(batch) == 1
            else:
                assert all(len(row) == 1 for row in batch)
            if spec.mode in FIXED_ROWS:
                assert len(batch) == spec.micro_batch_size
            else:
                assert micro_batch_cost(batch, lengths, spec)[1] <= spec.max_tokens_per_batch
    used = used_indices(plan)
    assert len(used) == len(set(used)), "a sample appears twice"
    assert set(used) <= set(range(len(lengths)))
    dropped = len(lengths) - len(used)
    if spec.mode in FIXED_ROWS:
        assert dropped == len(lengths) % (spec.world_size * spec.micro_batch_size)
    else:
        assert dropped < spec.world_size


@PROPERTY_SETTINGS
@given(cases())
def test_plan_covers_each_sample_once_within_budget(case):
    lengths, spec = case
    check_plan(plan_epoch(lengths, spec, epoch=3), lengths, spec)


@PROPERTY_SETTINGS
@given(cases(), st.integers(0, 5))
def test_ranks_agree_and_split_the_plan(case, epoch):
    lengths, spec = case
    samplers = [DistributedBatchSampler(lengths, spec, rank) for rank in range(spec.world_size)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    assert len({len(s) for s in samplers}) == 1, "every rank runs the same number of micro-steps"
    shares = [list(s) for s in samplers]
    plan = plan_epoch(lengths, spec, epoch)
    assert shares == [[step[rank] for step in plan] for rank in range(spec.world_size)]
    flat = [i for share in shares for batch in share for row in batch for i in row]
    assert len(flat) == len(set(flat)), "rank shares overlap"
    assert all(s.dropped == len(lengths) - len(flat) for s in samplers)


@PROPERTY_SETTINGS
@given(cases(), st.integers(0, 3), st.data())
def test_resume_yields_the_remaining_sequence(case, epoch, data):
    lengths, spec = case
    rank = data.draw(st.integers(0, spec.world_size - 1))
    original = DistributedBatchSampler(lengths, spec, rank)
    original.set_epoch(epoch)
    full = list(original)
    position = data.draw(st.integers(0, len(full)))
    original.skip(position)
    resumed = DistributedBatchSampler(lengths, spec, rank)
    resumed.load_state_dict(original.state_dict())
    assert resumed.state_dict() == {"epoch": epoch, "position": position, "world_size": spec.world_size}
    assert list(resumed) == full[position:]


@PROPERTY_SETTINGS
@given(cases(), st.integers(0, 2), st.data())
def test_a_run_on_another_number_of_processes_trains_each_step_on_the_same_micro_batches(case, epoch, data):
    """A checkpoint's plan, made for W ranks x A micro-steps, trained on W' ranks x A' micro-steps with W*A = W'*A'
    (a resume on another number of processes): every optimizer step, the epoch's last and short one included, trains
    on the plan's micro-batches of that step, in the order the plan holds them (micro-step by micro-step, rank by
    rank: where W or A is 1 the accumulation adds them as the plan's run did), so the epoch has as many steps; a
    short last step that W' ranks cannot share is refused when the sampler is built, not trained short. A data
    position saved at a step's end by the plan's own run resumes at the next step on the new layout, and back."""
    lengths, spec = case
    per_step, accum = spec.world_size * spec.grad_accum_steps, spec.grad_accum_steps
    world = data.draw(st.sampled_from([n for n in range(1, per_step + 1) if per_step % n == 0]))
    layout = Layout(world, per_step // world)
    plan = plan_epoch(lengths, spec, epoch)
    steps = [[batch for step in plan[k : k + accum] for batch in step] for k in range(0, len(plan), accum)]
    if len(steps[-1]) % world:
        with pytest.raises(ValueError, match="cannot share"):
            DistributedBatchSampler(lengths, spec, 0, layout=layout).set_epoch(epoch)
            DistributedBatchSampler(lengths, spec, 0, layout=layout).epoch_length(epoch)
        return
    samplers = [DistributedBatchSampler(lengths, spec, rank, layout=layout) for rank in range(world)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    columns = [list(sampler) for sampler in samplers]
    assert len(columns[0]) == sum(len(step) for step in steps) // world
    at = 0
    for k, planned in enumerate(steps):
        micro_steps = len(planned) // world
        trained = [columns[r][i] for i in range(at, at + micro_steps) for r in range(world)]
        assert trained == planned, k
        at += micro_steps
    k, rank = data.draw(st.integers(0, len(plan) // accum)), data.draw(st.integers(0, world - 1))
    own = DistributedBatchSampler(lengths, spec, 0)
    own.set_epoch(epoch)
    own.skip(k * accum)
    resumed = DistributedBatchSampler(lengths, spec, rank, layout=layout)
    resumed.load_state_dict(own.state_dict())
    assert list(resumed) == columns[rank][k * layout.grad_accum_steps :]
    back = DistributedBatchSampler(lengths, spec, 0)
    back.load_state_dict(resumed.state_dict())
    assert back.state_dict() == own.state_dict()


def test_a_layout_with_other_micro_batches_per_step_is_refused():
    spec = BatchingSpec(Batching.random, 2, 1, 0, grad_accum_steps=2)
    with pytest.raises(ValueError, match="other micro-batches"):
        DistributedBatchSampler(np.full(10, 5), spec, 0, layout=Layout(1, 2))


@PROPERTY_SETTINGS
@given(cases(min_samples=64))
def test_order_changes_between_epochs(case):
    lengths, spec = case
    first, second = plan_epoch(lengths, spec, 0), plan_epoch(lengths, spec, 1)
    if len(first) >= 8:  # with fewer micro-steps a repeat by chance is plausible
        assert first != second


@pytest.mark.parametrize("mode", list(Batching))
def test_plan_is_deterministic_in_seed_and_epoch(mode):
    lengths = make_lengths("skewed", 500, 0, 256)
    spec = BatchingSpec(mode, world_size=4, micro_batch_size=4, max_tokens_per_batch=1024, seed=7)
    assert plan_epoch(lengths, spec, 2) == plan_epoch(lengths.copy(), spec, 2)
    other_seed = BatchingSpec(mode, world_size=4, micro_batch_size=4, max_tokens_per_batch=1024, seed=8)
    assert plan_epoch(lengths, spec, 2) != plan_epoch(lengths, other_seed, 2)


@pytest.mark.parametrize("mode", [Batching.token_budget, Batching.packed])
@pytest.mark.parametrize("accum", [1, 4])
def test_variable_modes_balance_ranks_and_drop_nothing(mode, accum):
    lengths = make_lengths("skewed", 6000, 1, 1024)
    spec = BatchingSpec(mode, world_size=4, micro_batch_size=8, max_tokens_per_batch=1024, grad_accum_steps=accum)
    plan = plan_epoch(lengths, spec, 0)
    padded = np.array([[micro_batch_cost(b, lengths, spec)[1] for b in step] for step in plan])
    imbalance = padded.max(axis=1) / padded.mean(axis=1)
    assert np.percentile(imbalance, 99) <= (1.02 if mode is Batching.packed else 1.05)
    assert imbalance.max() <= 1.10
    assert len(used_indices(plan)) == len(lengths)
    assert len(plan) % accum == 0, "the epoch ends on a full optimizer step"


def test_costliest_micro_step_comes_first():
    lengths = make_lengths("skewed", 800, 2, 512)
    spec = BatchingSpec(Batching.length_grouped, world_size=2, micro_batch_size=4, max_tokens_per_batch=0)
    plan = plan_epoch(lengths, spec, 0)
    peaks = [max(micro_batch_cost(b, lengths, spec)[1] for b in step) for step in plan]
    assert peaks[0] == max(peaks)


def test_micro_batch_cost_pads_to_multiple_but_packed_does_not():
    lengths = np.array([10, 3, 7])
    padded = BatchingSpec(Batching.token_budget, 1, 1, 64, pad_to_multiple_of=8)
    packed = BatchingSpec(Batching.packed, 1, 1, 64, pad_to_multiple_of=8)
    assert micro_batch_cost([(0,), (1,), (2,)], lengths, padded) == (20, 48)
    assert micro_batch_cost([(0, 1, 2)], lengths, packed) == (20, 20)


def test_set_epoch_rewinds_and_caches():
    lengths = make_lengths("uniform", 200, 3, 100)
    sampler = DistributedBatchSampler(lengths, BatchingSpec(Batching.random, 2, 4, 0), rank=1)
    sampler.skip(5)
    plan = sampler._plan
    sampler.set_epoch(0)
    assert sampler.position == 0 and sampler._plan is plan
    sampler.set_epoch(1)
    assert sampler.epoch == 1 and sampler._plan is not plan
    assert len(sampler) == 200 // 8 and sampler.dropped == 0


@pytest.mark.parametrize(
    ("spec", "n", "message"),
    [
        (BatchingSpec(Batching.random, 4, 8, 0), 31, "data.micro_batch_size"),
        (BatchingSpec(Batching.packed, 4, 8, 512), 3, "dataset has 3 samples"),
        (BatchingSpec(Batching.token_budget, 1, 1, 100, pad_to_multiple_of=8), 5, "data.max_tokens_per_batch=100"),
    ],
)
def test_too_little_data_or_budget_is_a_clear_error(spec, n, message):
    with pytest.raises(ValueError, match=message):
        plan_epoch(np.full(n, 99), spec, 0)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match=r"data\.micro_batch_size must be >= 1"):
        BatchingSpec(Batching.length_grouped, 2, 0, 0)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        DistributedBatchSampler(np.full(10, 5), BatchingSpec(Batching.random, 2, 1, 0), rank=2)
    sampler = DistributedBatchSampler(np.full(10, 5), BatchingSpec(Batching.random, 2, 1, 0), rank=0)
    with pytest.raises(ValueError, match="position 6 is outside"):
        sampler.load_state_dict({"epoch": 0, "position": 6, "world_size": 2})
    with pytest.raises(ValueError, match="at least one token"):
        plan_epoch(np.array([3, 0, 2]), BatchingSpec(Batching.random, 1, 1, 0), 0)


def test_epoch_length_matches_the_plan_of_that_epoch():
    lengths = np.random.default_rng(3).integers(5, 300, size=500)
    spec = BatchingSpec(mode=Batching.token_budget, world_size=2, micro_batch_size=4, max_tokens_per_batch=600)
    sampler = DistributedBatchSampler(lengths, spec, rank=0)
    expected = [len(plan_epoch(lengths, spec, e)) for e in range(3)]
    assert [sampler.epoch_length(e) for e in range(3)] == expected
    sampler.set_epoch(2)
    assert len(sampler) == expected[2] == sampler.epoch_length(2)
