"""NVML, the NVIDIA driver's management library: the only code in redline that talks to it (``pynvml``).

Layered as nvitop is: ``query.py`` calls the bindings and classifies every answer (a value, "not
available", the GPU lost, NVML gone); ``device.py`` turns answers into quantities in base units, one
method each; ``probe.py`` (the snapshot's GPU section, read once) and ``live.py`` (``GpuStateReader``,
read again and again by the monitor and the bench) are built on it.
"""
