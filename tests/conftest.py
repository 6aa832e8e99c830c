import pytest

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
