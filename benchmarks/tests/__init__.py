"""The benchmarks' own tests: `python -m pytest -q benchmarks/tests` from the repository root (not in `testpaths`).

A package, so that pytest puts the repository root on sys.path (``import benchmarks``) and these modules never
collide by name with those under tests/.
"""
