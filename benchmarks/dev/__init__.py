"""One-off investigations: profilers, sweeps and diagnostics behind a kernel decision (GPU only)."""
