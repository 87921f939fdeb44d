"""Summarise py-spy profiles of a serve member during ingest (bench/host_members.py
``--profile-member DIR``: ``py-spy record --threads --subprocesses --format raw``, one
collapsed stack and its sample count a line) into JSON: per process (the member, each
consumer process) and thread (its name, ids dropped), the samples and their share of the
profile's wall time, and within each thread the functions holding the most samples, by
self (the innermost frame) and inclusive (anywhere on the stack) count.

    .venv/bin/python bench/experiments/member_profile.py DIR/*.txt --rate 100 --json PATH

A thread's share is samples / (rate x the profile's seconds): 1.0 is a thread busy (on
CPU, or in a blocking call py-spy counts as active) the whole time. py-spy leaves idle
samples out, so a thread's share is its busy share.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchinfo import git_commit, machine, write_result  # noqa: E402

TOP = 15


def _process(frame: str) -> str:
    """'process 123:"python -m recmem.cli serve ..."' -> 'serve' / the child's module."""
    cmd = frame.partition(":")[2].strip('"')
    if "recmem.cli serve" in cmd:
        return "member"
    m = re.search(r"multiprocessing\.(spawn|forkserver)", cmd)
    return "child process" if m else cmd[:60]


def _thread(frame: str) -> str:
    """'thread (123): engine-loop' -> 'engine-loop'; numbered pool threads lose numbers."""
    name = frame.partition(":")[2].strip() or "unnamed"
    return re.sub(r"[-_ ]?\d+", "", name.split(" (")[0]) or "unnamed"


def _fn(frame: str) -> str:
    """'Engine.compute (recmem/engine/engine.py:375)' -> 'Engine.compute (recmem/engine/engine.py)'."""
    return re.sub(r":\d+\)$", ")", frame)


def summarise(raw: Path, rate: float, seconds: float | None) -> dict[str, object]:
    by_thread: Counter[str] = Counter()
    selfs: dict[str, Counter[str]] = {}
    inclusive: dict[str, Counter[str]] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        proc = _process(frames[0]) if frames[0].startswith("process ") else "member"
        rest = frames[1:] if frames[0].startswith("process ") else frames
        thread = _thread(rest[0]) if rest and rest[0].startswith("thread ") else "unnamed"
        body = [_fn(f) for f in rest[1:]] if rest and rest[0].startswith("thread ") else rest
        key = f"{proc} / {thread}"
        by_thread[key] += n
        total += n
        if body:
            selfs.setdefault(key, Counter())[body[-1]] += n
        inc = inclusive.setdefault(key, Counter())
        for f in set(body):
            inc[f] += n
    span = seconds if seconds else None
    out: dict[str, object] = {"samples": total, "threads": {}}
    for key, n in by_thread.most_common():
        entry: dict[str, object] = {"samples": n}
        if span:
            entry["busy_share"] = round(n / (rate * span), 3)
        entry["self_top"] = [
            [f, c, round(c / n, 3)] for f, c in selfs.get(key, Counter()).most_common(TOP)
        ]
        entry["inclusive_top"] = [
            [f, c, round(c / n, 3)] for f, c in inclusive.get(key, Counter()).most_common(TOP)
        ]
        out["threads"][key] = entry  # type: ignore[index]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("raw", nargs="+", help="py-spy raw profiles")
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate")
    ap.add_argument(
        "--seconds",
        default="",
        help="comma-separated profile lengths (s), one per file, for the busy shares",
    )
    ap.add_argument("--command", default="", help="the command that made the profiles")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    secs = [float(x) for x in args.seconds.split(",") if x] if args.seconds else []
    result = {
        "benchmark": "member_profile",
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": args.command,
        "rate_hz": args.rate,
        "profiles": {
            Path(p).stem: summarise(Path(p), args.rate, secs[i] if i < len(secs) else None)
            for i, p in enumerate(args.raw)
        },
    }
    write_result(Path(args.json), result)


if __name__ == "__main__":
    main()
