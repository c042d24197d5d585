"""Reports on a file: the `inspect` summary and the NaN/Inf scan."""
