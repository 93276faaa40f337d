"""The slow tests first: pytest-xdist's load scheduling then hands them out one by one while the
fast ones fill the end, instead of one worker finishing a long test alone."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order
