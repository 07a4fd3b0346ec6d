"""A benchmark's run and its report on disk: the run's JSON beside its markdown report, so the
figures can be checked, and the report rewritten from a saved run (`--report-only RUN_JSON`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def measure_and_report(args: argparse.Namespace, measure: Callable[[argparse.Namespace], dict[str, Any]],
                       report: Callable[[dict[str, Any]], str]) -> int:
    """Measure (or read `args.report_only`), write `args.out` and its `.json`, print the report."""
    if args.report_only:
        data = json.loads(Path(args.report_only).read_text())
    else:
        data = measure(args)
        Path(args.out).with_suffix(".json").write_text(json.dumps(data, indent=1))
    text = report(data)
    Path(args.out).write_text(text)
    print(text)
    return 0
