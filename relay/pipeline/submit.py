"""spark-submit's entry point: `spark-submit [options] …/relay/pipeline/submit.py all --lake …`
(`python -m relay.pipeline.submit …` is the same without spark-submit)."""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    # Run as a file, this folder is first on sys.path: the package's modules (lake, report, …)
    # must not pass for top-level ones.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from relay.pipeline.commands import pipeline  # after the path is fixed

    pipeline(prog_name="outbox-relay pipeline")


if __name__ == "__main__":
    main()
