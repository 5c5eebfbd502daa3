"""Hold a local single-node Slurm open under DIR until Ctrl-C: ``PYTHONPATH=tools python -m slurmlocal DIR``."""

from __future__ import annotations

import argparse
import contextlib
import signal
from pathlib import Path

from slurmlocal import LocalSlurm


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(prog="slurmlocal", description=__doc__)
    parser.add_argument("root", type=Path, help="a directory for the configuration, state, logs and device files")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--accounting", action="store_true", help="also MariaDB and slurmdbd, for sacct")
    args = parser.parse_args()
    with LocalSlurm(args.root, gpus=args.gpus, accounting=args.accounting) as cluster:
        print(f"export SLURM_CONF={cluster.conf}   # Ctrl-C stops the cluster", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
