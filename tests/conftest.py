import pytest
from hypothesis import settings

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
