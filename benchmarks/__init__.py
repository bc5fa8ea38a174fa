"""Benchmark suites; each module has ``main(argv) -> dict`` and runs as a script."""
