"""Helpers shared by the tests and the benchmarks (synthetic datasets, reference states, self-distilled
answers): not part of the installed core."""
