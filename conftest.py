"""The slow tests first: pytest-xdist's load scheduling then hands them out one at a time and
the fast ones fill the end (pytest.ini gives the measured times)."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order
