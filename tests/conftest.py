import os
import tempfile

import pytest
from hypothesis import settings

# Traced activation profiles go to a private cache: the tests never read or write the user's ~/.cache.
os.environ["MEMPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="memplan-test-cache-")

# Deterministic property tests: the same examples on every run, so CI cannot flake on a rare draw.
settings.register_profile("memplan", derandomize=True, deadline=None)
settings.load_profile("memplan")

from memplan.model import sources


@pytest.fixture(scope="session")
def inventories():
    cache = {}

    def get(name, builder="auto"):
        key = (name, builder)
        if key not in cache:
            cache[key] = sources.build_inventory(sources.resolve(name), builder=builder)
        return cache[key]

    return get
