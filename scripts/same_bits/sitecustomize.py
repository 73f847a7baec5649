"""scripts/same-bits only (never in the product): in a worker (RANK set, FDL_BITS_DET=1), replace the
timing-dependent decisions of El Che with fixed ones, so two checkouts train the same rounds and
their models can be compared bit for bit: no elastic early stop, a round-robin split of shared
pools, each rank's speed fixed at (1 + rank) ms a sample, every average costing 0.5 ms."""
import math
import os

if os.environ.get("RANK") is not None and os.environ.get("FDL_BITS_DET") == "1":
    from fdl.engine import round_messages, state

    class FixedSignal:
        def __init__(self, plan):
            self.plan = plan

        @classmethod
        def open(cls, plan, *, rank):
            return cls(plan)

        def arrived(self, plan):
            return False

        def close(self, plan, *, rank, used):
            return None if plan.elastic is None else plan.slices[plan.elastic].num_samples

    class FixedPool:
        def __init__(self, size, world_size):
            self.size, self.world_size, self.done = size, world_size, False

        @classmethod
        def open(cls, plan, *, world_size, chunk=1, share=0.0):
            return cls(plan.pool or 0, world_size)

        def take(self):
            if self.done or not self.size:
                return range(0)
            self.done = True
            rank = int(os.environ["RANK"])
            return range(rank, self.size, self.world_size)

        def close(self):
            return self.size or None

    round_messages.ElasticSignal = FixedSignal
    round_messages.SharedPool = FixedPool
    _report = state.RankState.report

    def report(self, *, busy_ms, samples, **kw):
        rank = int(os.environ["RANK"])
        fixed = busy_ms if math.isnan(busy_ms) else samples * (1.0 + rank)
        return _report(self, busy_ms=fixed, samples=samples, **kw)

    def after_sync(self, elapsed_ms, *, blocking):
        self.last_blocking_ms = self.last_wait_ms = 0.5

    state.RankState.report = report
    state.RankState.after_sync = after_sync
