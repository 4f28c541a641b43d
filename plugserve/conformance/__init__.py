"""The conformance kit: every backend, built-in or third-party, checked against the kit's oracle.

    pytest --pyargs plugserve.conformance --plugserve-backend attention:mykernel

The pytest plugin (`plugserve.conformance.plugin`, registered through the `pytest11` entry point) adds
the options and parametrizes the kit's tests over the chosen backends and every dtype they claim;
shape grids live in `cases.py`, tolerances in `tolerances.py`, and what every backend must compute
in `oracle.py` (float64, independent of every backend, torch_ref included).
"""
