"""The conformance kit: every backend, built-in or third-party, checked against the torch reference.

    pytest --pyargs plugserve.testing --plugserve-backend attention:mykernel

The pytest plugin (`plugserve.testing.plugin`, registered through the `pytest11` entry point) adds
the options and parametrizes the kit's tests over the chosen backends and every dtype they claim;
shape grids live in `cases.py`, tolerances in `tolerances.py`.
"""
