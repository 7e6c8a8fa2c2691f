"""gloo worker ranks launched once per test module and kept for its engines."""
from __future__ import annotations

from collections.abc import Iterator

from slipstream.parallel import workers


def kept_pool(ranks: int) -> Iterator[workers.WorkerPool]:
    """A module fixture's body: `ranks` CPU worker processes, launched now (their start-up
    overlaps the module's single-rank runs) and handed to the engines the module builds."""
    with workers.keep_pools():
        launched = workers.new_pool(ranks, "cpu", "mp")
        launched.launch()
        workers.keep(launched)
        yield launched
