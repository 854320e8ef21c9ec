"""KV cache: the paged block pool, live, beside the local PC's contiguous reservations;
scripted scenarios for prefix sharing, preemption and fragmentation."""

from ui import kv_view as view

view.intro()

# Three scripted workloads, each on an engine of its own: prefix caching and block size.
view.controls()

# Live: usage, waste, hit rate, preemptions; the paged block map beside the contiguous
# layout; the scheduler's steps; the last scenario's result and waste vs block size.
view.live()

view.how_measured()
