"""Property tests: random interleavings of add / step / abort never leak or double-free
a block, never exceed the budget, keep the integrity check, and always finish."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.core.request import RequestStatus

from .helpers import make_request, make_scheduler, run_to_completion, step

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(3, 6), min_size=1, max_size=14),  # tiny vocab: shared prefixes
            st.integers(1, 8),
            st.sampled_from([None, "s1"]),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(8, 30),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 4),
    prefix_caching=st.booleans(),
)
def test_random_interleavings_keep_the_pool_consistent(ops, block_size, num_blocks, budget, max_num_seqs, prefix_caching):
    max_model_len = min(num_blocks * block_size, 24)
    s = make_scheduler(num_blocks, block_size, budget, max_num_seqs, max_model_len, prefix_caching)
    added = []
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, salt = op
            if len(prompt) + max_tokens > max_model_len:
                continue
            req = make_request(f"r{len(added)}", prompt, max_tokens=max_tokens, salt=salt, ignore_eos=True)
            s.add_request(req)
            added.append(req)
        elif op[0] == "step":
            step(s)
        elif added:
            victim = added[op[1] % len(added)]
            s.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
            s.check_integrity()
    run_to_completion(s)
    kv = s.kv
    assert kv.pool.num_used == 0
    assert kv.pool.num_free + kv.num_cached_blocks == kv.num_blocks
    for req in added:
        assert req.is_finished
        assert req.block_ids == []
        if req.status == RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == req.sampling_params.max_tokens
