"""Test doubles: stand-ins for the services jdp talks to, for the tests and `make bench`.

They live with the tests, not in `jdp/`, so the library ships none. Tests import them as
`doubles.<name>` (tests/ is on the import path under pytest); the benchmarks, run from the
repository's root, as `tests.doubles.<name>`.
"""
