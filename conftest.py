"""Root conftest: the specaudit plugin itself is loaded through its pytest11 entry point
(pyproject.toml), so `pytest properties/` works the same inside this repo and in a user's."""

pytest_plugins = ["pytester"]
