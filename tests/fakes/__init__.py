"""Fakes of the outside world (NVML...) that tests build realistic servers from."""
